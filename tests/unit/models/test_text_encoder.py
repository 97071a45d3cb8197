"""Token cache (xc.data.tokens) and transformer encoder (xc.models.text_encoder) on the real
bundled all-MiniLM-L6-v2 weights. Runs offline; about 20 s on 2 CPU cores."""

from __future__ import annotations

import os
import pickle
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xc.data.tokens import TokenCache, tokenize_to_cache
from xc.errors import ConfigError, DataFormatError
from xc.models.text_encoder import TransformerEncoder, default_minilm_path

TEXTS = [
    "Automatic Trait Loading and Resolution for Catalyst Components.",
    "",  # empty line: still a row ([CLS] [SEP])
    "naïve café – ünïcödé, 東京 and emoji 🙂",
    "a literal [PAD] token and trailing spaces   ",
    "word " * 200,  # far longer than max_len: truncated
    "single-file and single-user revision control system.",
]
MAX_LEN = 16


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_minilm_path()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


@pytest.fixture(scope="module")
def encoder(model_path) -> TransformerEncoder:
    torch.manual_seed(0)
    return TransformerEncoder(model_path, pooling="mean").eval()


def _write(path, lines, newline="\n"):
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return str(path)


# ---------------------------------------------------------------- token cache


def test_default_path_is_the_bundled_model(model_path):
    assert os.path.basename(model_path) == "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(model_path, name))


def test_cache_round_trip_matches_tokenizer(tmp_path, model_path, tokenizer):
    src = _write(tmp_path / "t.txt", TEXTS, newline="\r\n")  # CRLF is stripped like LF
    cache = tokenize_to_cache(src, model_path, MAX_LEN, str(tmp_path / "c"), progress=False)
    assert cache.num_rows == len(TEXTS) == len(cache)
    assert cache.ids.dtype == np.int32 and cache.ids.shape == (len(TEXTS), MAX_LEN)
    assert cache.lengths.dtype == np.int32

    ref = tokenizer(TEXTS, max_length=MAX_LEN, truncation=True, padding="max_length")
    np.testing.assert_array_equal(cache.ids, np.array(ref["input_ids"]))
    np.testing.assert_array_equal(cache.lengths, np.array(ref["attention_mask"]).sum(1))

    rows = np.array([5, 0, 0, 1])
    b = cache.gather(rows)
    t_b = max(sum(ref["attention_mask"][r]) for r in rows)
    assert b["input_ids"].dtype == b["attention_mask"].dtype == torch.int64
    assert b["input_ids"].shape == b["attention_mask"].shape == (4, t_b) and t_b < MAX_LEN
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(b["input_ids"][i].numpy(), ref["input_ids"][r][:t_b])
        np.testing.assert_array_equal(b["attention_mask"][i].numpy(), ref["attention_mask"][r][:t_b])
    # The long text fills max_len and ends with [SEP].
    assert cache.lengths[4] == MAX_LEN and cache.ids[4, -1] == tokenizer.sep_token_id
    # A literal "[PAD]" is a real token: counted in the length, not mistaken for padding.
    assert tokenizer.pad_token_id in cache.ids[3, : cache.lengths[3]]

    with pytest.raises(IndexError):
        cache.gather(np.array([len(TEXTS)]))
    # Pickles as a path (workers re-map), not as a copy of the arrays.
    clone = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < 1000
    np.testing.assert_array_equal(clone.gather(rows)["input_ids"], b["input_ids"])


def test_cache_reused_then_rebuilt_when_inputs_change(tmp_path, model_path):
    src_path = tmp_path / "t.txt"
    src = _write(src_path, TEXTS[:3])
    cdir = str(tmp_path / "c")
    ids_file = os.path.join(cdir, "ids.npy")

    tokenize_to_cache(src, model_path, MAX_LEN, cdir, progress=False)
    ino = os.stat(ids_file).st_ino
    again = tokenize_to_cache(src, model_path, MAX_LEN, cdir, progress=False)
    assert os.stat(ids_file).st_ino == ino and again.num_rows == 3  # re-used, not rewritten

    _write(src_path, TEXTS[:4])  # source changed: rebuilt
    old_view = TokenCache(cdir)
    new = tokenize_to_cache(src, model_path, MAX_LEN, cdir, progress=False)
    assert new.num_rows == 4 and os.stat(ids_file).st_ino != ino
    assert old_view.gather(np.arange(3))["input_ids"].shape[0] == 3  # old maps stay valid

    ino = os.stat(ids_file).st_ino
    wider = tokenize_to_cache(src, model_path, MAX_LEN + 8, cdir, progress=False)  # setting changed
    assert wider.max_len == MAX_LEN + 8 and os.stat(ids_file).st_ino != ino
    # No temp directories are left next to the cache.
    assert sorted(os.listdir(tmp_path)) == ["c", "c.lock", "t.txt"]


def test_concurrent_builders_do_not_collide(tmp_path, model_path):
    # flock locks belong to open file descriptions, so threads contend like processes do.
    src = _write(tmp_path / "t.txt", TEXTS * 50)
    cdir = str(tmp_path / "c")
    results, errors = [], []

    def build():
        try:
            results.append(tokenize_to_cache(src, model_path, MAX_LEN, cdir, progress=False).num_rows)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [len(TEXTS) * 50] * 3


def test_non_utf8_line_is_named(tmp_path, model_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine\nalso fine\nbroken \xff\xfe here\nlast\n")
    with pytest.raises(DataFormatError) as err:
        tokenize_to_cache(str(src), model_path, MAX_LEN, str(tmp_path / "c"), progress=False)
    assert err.value.line == 3 and err.value.field == "text" and "bad.txt:3" in str(err.value)
    assert not os.path.exists(tmp_path / "c")  # nothing half-built is left behind


def test_bad_inputs_raise_library_errors(tmp_path, model_path):
    with pytest.raises(DataFormatError):
        tokenize_to_cache(str(tmp_path / "missing.txt"), model_path, MAX_LEN, str(tmp_path / "c"))
    src = _write(tmp_path / "t.txt", TEXTS)
    with pytest.raises(ConfigError):
        tokenize_to_cache(src, model_path, 1, str(tmp_path / "c"))
    with pytest.raises(ConfigError):
        TransformerEncoder(str(tmp_path), pooling="mean")  # not a model directory
    with pytest.raises(ConfigError):
        TransformerEncoder(None, pooling="max")


# ---------------------------------------------------------------- encoder


def test_embeddings_match_direct_mean_pooling(encoder, tokenizer):
    from transformers import AutoModel

    sentences = ["The cat sits outside.", "A man is playing guitar in the park at night."]
    # Padded to 32 so the encoder's trimming of all-padding columns is exercised.
    enc = tokenizer(sentences, max_length=32, padding="max_length", truncation=True, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    with torch.no_grad():
        got = encoder(batch)
        ref_model = AutoModel.from_pretrained(encoder.path, local_files_only=True).eval()
        h = ref_model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        ref = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    assert encoder.out_dim == 384 and got.shape == (2, 384) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_similar_sentences_score_higher(encoder, tokenizer):
    texts = [
        "A man is playing a guitar.",
        "Someone is strumming an acoustic guitar.",
        "The central bank raised interest rates again.",
    ]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        e = F.normalize(encoder(batch), dim=-1)
    sim_close, sim_far = float(e[0] @ e[1]), float(e[0] @ e[2])
    assert sim_close > 0.5 and sim_far < 0.2 and sim_close - sim_far > 0.4


def test_gradients_flow_and_options(model_path, tmp_path):
    src = _write(tmp_path / "t.txt", TEXTS)
    cache = tokenize_to_cache(src, model_path, MAX_LEN, str(tmp_path / "c"), progress=False)
    batch = cache.gather(np.arange(len(TEXTS)))

    enc = TransformerEncoder(model_path, pooling="cls", normalize=True, gradient_checkpointing=True).train()
    assert enc.model.pooler is None  # unused params would break DDP
    assert getattr(enc.model, "is_activation_checkpointing", None) or enc.model.is_gradient_checkpointing
    out = enc(batch)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(TEXTS)))
    out[:, :8].sum().backward()
    grads = {n: p.grad for n, p in enc.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert grads["model.embeddings.word_embeddings.weight"].abs().sum() > 0
    assert grads["model.encoder.layer.5.output.dense.weight"].abs().sum() > 0
    # dropout=0 (default): train mode gives the eval-mode embedding.
    with torch.no_grad():
        torch.testing.assert_close(enc.eval()(batch), out.detach())
