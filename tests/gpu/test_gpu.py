"""GPU tests: run wherever CUDA is present, skipped elsewhere (tests/conftest.py skips the `gpu` marker).

    .venv/bin/python -m pytest tests/gpu -m gpu       # on a CUDA machine (tools/setup.sh --gpu)

What they prove there: 2 NCCL ranks train to the model 1 CUDA process trains (needs 2 GPUs); every encoder
type trains on the GPU; bf16 autocast with bf16 rows and fp32 masters, and fp16 with loss scaling, train;
pinned batches prefetched on the thread give the weights an inline run gives; faiss_gpu mines on the GPU;
the torch ANN backend searches on the GPU.
On CUDA, scatter-add kernels (EmbeddingBag and index_add backward) are not bitwise deterministic, so
weights are compared with tolerances here where the CPU tests demand equality.
"""

from __future__ import annotations

import dataclasses
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import REPO, load_final_state, run_cli

pytestmark = pytest.mark.gpu

SMALL = ["data.name=gpu-small", "data.synthetic.num_train=2000", "data.synthetic.num_test=400",
         "data.synthetic.num_labels=1000", "data.synthetic.num_features=3000", "model.embed_dim=64",
         "train.epochs=2", "train.batch_size=128", "train.warmup_steps=3", "train.log_every=5",
         "sampler.k_hard=8", "sampler.k_random=32", "sampler.start_epoch=1", "logger.wandb=disabled",
         "logger.progress=false", "train.resume=never", "train.device=cuda"]


def _events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if e["event"] == kind]


def _close(a, b, rtol=1e-3, atol=1e-4):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name].float(), a[name].float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"NCCL equivalence needs 2 GPUs, this machine has "
                    f"{torch.cuda.device_count()} (NCCL refuses 2 ranks on one device)")
def test_nccl_two_ranks_equal_one_process(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*SMALL, cache, "parallel.num_label_shards=2"]
    run_cli([*args, f"run_dir={one}"], cwd=REPO)
    proc = run_cli([*args, f"run_dir={two}", "parallel.backend=nccl"], cwd=REPO, nproc=2)
    assert "(nccl)" in proc.stdout + proc.stderr and "cuda:0" in proc.stdout + proc.stderr
    _close(load_final_state(one, 1), load_final_state(two, 2))
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert abs(m1["P@1"] - m2["P@1"]) < 0.5, (m1, m2)


def _tiny_lf(root):
    from tests.integration.test_ehard import _write_lf

    root.mkdir()
    _write_lf(root, num_train=256, num_test=64)
    return ["model=minilm", "data.kind=lf_raw", f"data.path={root}", "data.name=tinylf-gpu", "data.max_len=16",
            "data.label_text_augmentation=false", "train.batch_size=32", "sampler.k_hard=4", "sampler.k_random=8",
            "eval.batch_size=64"]


@pytest.mark.parametrize("encoder", ["bow", "dense", "minilm"])
def test_short_training_run_per_encoder(tmp_path, encoder):
    run = tmp_path / "run"
    extra = _tiny_lf(tmp_path / "lf") if encoder == "minilm" else [f"model={encoder}"]
    proc = run_cli([*SMALL, *extra, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run}"], cwd=REPO)
    assert "on cuda:0" in proc.stdout + proc.stderr
    # the CUDA defaults: batches assembled on the device, so no prefetch thread
    assert "prefetch off, device batches on" in proc.stdout + proc.stderr
    train = _events(run, "train")
    assert all(np.isfinite(e["loss"]) for e in train)
    # the sampled softmax's loss has a floor (log of the negatives' mass): on CPU the bow run's falls 29.0 -> 20.8
    assert train[-1]["loss"] < 0.85 * train[0]["loss"], [e["loss"] for e in train]
    if encoder != "minilm":  # on CPU these settings give P@1 66 (bow) and 63 (dense); the 20-label text toy
        # data does not get past chance in 2 epochs (6.25 on CPU) while its loss falls from 406 to 155
        assert json.loads((run / "metrics.json").read_text())["P@1"] > 40


def test_bf16_amp_bf16_rows_and_fp16_loss_scaling(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    bf16, fp16 = tmp_path / "bf16", tmp_path / "fp16"
    run_cli([*SMALL, cache, f"run_dir={bf16}", "train.amp=bf16", "model.classifier_dtype=bfloat16",
             "train.profile_phases=true"], cwd=REPO)
    assert json.loads((bf16 / "metrics.json").read_text())["P@1"] > 40
    clf = torch.load(sorted((bf16 / "checkpoints").glob("step-*[0-9]"))[-1] / "rank0.pt", weights_only=True)
    assert torch.equal(clf["classifier"]["weight"], clf["classifier"]["master"].to(torch.bfloat16))
    assert all("phase_seconds" in e for e in _events(bf16, "train"))

    run_cli([*SMALL, cache, f"run_dir={fp16}", "train.amp=fp16"], cwd=REPO)
    assert json.loads((fp16 / "metrics.json").read_text())["P@1"] > 40
    train = _events(fp16, "train")
    assert all(e["loss_scale"] >= 1.0 for e in train) and train[-1]["skipped_steps"] == 0


def test_prefetch_on_cuda_matches_inline_and_pins_batches(tmp_path):
    from xc.train.modes.classifier.batches import BatchPreparer, to_device_prepared
    from xc.config import build_config
    from xc.sampling import StepKey, build_sampler
    from xc.shards import ShardLayout

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    inline, ahead = tmp_path / "inline", tmp_path / "ahead"
    run_cli([*SMALL, cache, f"run_dir={inline}", "train.prefetch=false"], cwd=REPO)
    run_cli([*SMALL, cache, f"run_dir={ahead}", "train.prefetch=true"], cwd=REPO)
    _close(load_final_state(inline, 1), load_final_state(ahead, 1))

    cfg = build_config({"sampler": {"name": "uniform", "k_hard": 0, "k_random": 8, "k_pos": 2}})
    layout = ShardLayout.build(64, 1, 16)
    labels = SimpleNamespace(
        num_rows=16, inputs=lambda rows: {"x": torch.from_numpy(np.asarray(rows, dtype=np.float32))},
        labels=lambda rows: (np.arange(len(rows) + 1, dtype=np.int64), np.asarray(rows, dtype=np.int64) % 64))
    c = SimpleNamespace(sampler=build_sampler(cfg.sampler, layout, 0, np.ones(64)), train=labels, micro_batch=8,
                        layout=layout, my_shards=range(1), shard=SimpleNamespace(lo=0, hi=64))
    device = torch.device("cuda", 0)
    prep = BatchPreparer(cfg, c, SimpleNamespace(rank=0, world_size=1, device=device, active=False))
    batch = prep(0, np.arange(8), StepKey(0, 0, 0))
    assert batch.inputs["x"].is_pinned() and batch.cand.local_ids.is_pinned() and batch.positives.ids.is_pinned()
    inputs = to_device_prepared(batch, device, sampled=True)
    assert inputs["x"].device == device and batch.cand.weight.device == device


def test_faiss_gpu_miner_runs_on_the_gpu(tmp_path):
    from xc.ann import faiss_backend

    if faiss_backend.num_gpus() == 0:
        pytest.skip(f"faiss sees no GPU: {faiss_backend.gpu_status()[1]} (bash tools/setup.sh --gpu installs faiss-gpu)")
    run = tmp_path / "run"
    proc = run_cli([*SMALL, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run}",
                    "miner.ann.backend=faiss_gpu"], cwd=REPO)
    assert "falling back" not in proc.stdout + proc.stderr
    (mined,) = _events(run, "negatives")
    assert all(s["recall"] == 1.0 for s in mined["shards"])  # GpuIndexFlatIP: exact


def test_torch_backend_searches_on_the_gpu_and_equals_exact():
    """miner.ann.backend=torch: rows on this rank's GPU; float32 ids equal the CPU exact backend's (up to
    ties of equal scores), bfloat16 keeps recall@16 >= 0.95 against them."""
    from xc.ann.base import AnnParams, recall_at_k
    from xc.ann.registry import build_index

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((20_000, 64)).astype(np.float32)
    queries = rng.standard_normal((2_000, 64)).astype(np.float32)
    exact = build_index("exact", AnnParams())
    exact.build(rows)
    _, ref = exact.search(queries, 16)
    gpu = build_index("torch", AnnParams(torch_device="cuda"))
    gpu.build(rows)
    assert gpu.device.startswith("cuda") and gpu._rows.is_cuda
    _, ids = gpu.search(queries, 16)
    assert recall_at_k(ids, ref) >= 0.999
    half = build_index("torch", AnnParams(torch_device="cuda", torch_dtype="bfloat16"))
    half.build(rows)
    assert recall_at_k(half.search(queries, 16)[1], ref) >= 0.95


def test_device_batches_on_cuda_equal_the_host_where_exact_and_draw_the_stated_distribution(tmp_path):
    from tests.unit.train.modes.classifier.test_device_batches import K_HARD, _trainer
    from xc.train.modes.classifier.batches import BatchPreparer
    from xc.sampling import SampleBatch, StepKey

    trainer = _trainer(tmp_path, device="cuda")
    c = trainer.mode.c
    rows = np.random.default_rng(0).permutation(c.train.num_rows)[:c.micro_batch]
    key = StepKey(0, 1, 0)
    host = BatchPreparer(trainer.cfg, c, trainer.ctx)(0, rows, key)
    device = trainer.mode.preparer(0, rows, key)
    assert device.cand.local_ids.is_cuda and device.inputs["feat_ids"].is_cuda
    for name in host.inputs:
        assert torch.equal(host.inputs[name], device.inputs[name].cpu()), name
    k_pos = host.positives.ids.shape[1]
    hard = slice(k_pos, k_pos + K_HARD)
    assert torch.equal(host.cand.local_ids[:, hard], device.cand.local_ids[:, hard].cpu())
    # the positives: a CUDA generator draws another subsample, of the same sets with the same weights
    assert torch.equal(host.positives.keys, device.positives.keys.cpu())
    assert torch.equal(host.positives.weight.sum(1), device.positives.weight.sum(1).cpu())

    batch = SampleBatch(torch.arange(4, device="cuda"), torch_only=True)
    steps, n = 3000, c.layout.real_count(0)
    counts = torch.zeros(4, n, dtype=torch.float64, device="cuda")
    for step in range(steps):
        draw = c.sampler.sample(StepKey(5, 1, step), 0, batch)
        hit = torch.zeros_like(counts, dtype=torch.bool)
        hit[torch.arange(4, device="cuda").unsqueeze(1).expand_as(draw.ids), draw.ids] = True
        counts += hit
    expected = c.sampler.distribution(0, SampleBatch(torch.arange(4))).cuda() * steps
    soft = expected < steps
    assert torch.equal(counts[~soft], expected[~soft])
    assert float((((counts[soft] - expected[soft]) ** 2) / expected[soft]).mean()) < 1.3


@pytest.mark.parametrize("pool", [0, 64])
def test_static_shapes_on_cuda_assemble_without_a_sync_and_keep_the_device_draws(tmp_path, pool):
    """train.static_shapes (auto-on with CUDA): no assembly op waits for the GPU (sync debug mode "error"), every
    shape is the same from batch to batch, the hard block and the positives' keys equal the dynamic device path's,
    and padded pool columns weigh nothing."""
    from tests.unit.train.modes.classifier.test_static_shapes import _both
    from tests.unit.train.modes.classifier.test_static_shapes import _trainer as static_trainer
    from xc.sampling import POSITIVE_STREAM, StepKey
    from xc.sampling.fixed_shapes import draw_positives_static
    from xc.train.modes.classifier.device_batches import StaticBatchPreparer
    from xc.train.modes.classifier.step import draw_candidates

    trainer = static_trainer(tmp_path, pool, device="cuda")
    c, cfg, ctx, prep = trainer.mode.c, trainer.cfg, trainer.ctx, trainer.mode.preparer
    assert isinstance(prep, StaticBatchPreparer)
    dyn, sta = _both(trainer, 0)  # also makes the resident hard tables before the sync check
    nnz = dyn.positives.keys.numel()
    assert torch.equal(sta.positives.keys[:nnz], dyn.positives.keys)
    k = dyn.cand.num_pos + 4  # the first hard slots of shard 0
    assert torch.equal(sta.cand.local_ids[:, dyn.cand.num_pos:k], dyn.cand.local_ids[:, dyn.cand.num_pos:k])
    shapes = set()
    for step in range(3):
        rows = torch.as_tensor(np.random.default_rng(step).permutation(c.train.num_rows)[:c.micro_batch]).cuda()
        key = StepKey(0, 1, step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ids, counts = prep.labels.gather_padded(rows, prep.width)
            positives = draw_positives_static(ids, counts, cfg.sampler.k_pos, c.layout.padded_labels,
                                              key.generator(POSITIVE_STREAM, rows.device))
            cand = draw_candidates(cfg.sampler, c, ctx, rows, key, positives, torch_only=True, static=True).dense()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        shapes.add(tuple(tuple(t.shape) for t in (*vars(positives).values(), *vars(cand).values())
                         if isinstance(t, torch.Tensor)))
    assert len(shapes) == 1, shapes


def test_device_batches_train_as_well_as_the_host_path(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    scores = {}
    for setting in ("true", "false"):
        run = tmp_path / setting
        proc = run_cli([*SMALL, cache, f"run_dir={run}", f"train.device_batches={setting}"], cwd=REPO)
        assert f"device batches {'on' if setting == 'true' else 'off'}" in proc.stdout + proc.stderr
        scores[setting] = json.loads((run / "metrics.json").read_text())["P@1"]
    assert scores["true"] > 40 and abs(scores["true"] - scores["false"]) < 3, scores


def test_the_corrector_mines_and_trains_on_the_gpu_as_on_the_cpu(tmp_path):
    """The dual mode's corrector keeps its cache copy, h and h's Adam on the rank's GPU: the same ids, as good an h."""
    from tests.unit.sampling.test_label_cache import _drift_setup, _spec
    from xc.sampling.cache_registry import build_cache_source
    from xc.sampling.corrector import truncated_kl

    gen, stale, fresh = _drift_setup(n=3000, d=32)
    sources = {}
    for device in ("cpu", "cuda"):
        name, spec = _spec(tmp_path / device, "corrector", n=3000, dim=32, corrector_hidden=64, cache_mine_chunk=1000,
                            corrector_lr=3e-3)
        sources[device] = build_cache_source(name, dataclasses.replace(spec, device=torch.device(device)))
        sources[device].refresh(0, lambda ids: stale[torch.from_numpy(ids)])
    for step in range(100):
        q = torch.randn(64, 32, generator=gen)
        ids = torch.randperm(3000, generator=gen)[:256]
        mined = {d: s.mine(q.to(d), 16, gen)[0] for d, s in sources.items()}
        assert mined["cuda"].device.type == "cpu"
        assert (mined["cuda"] == mined["cpu"]).float().mean() > 0.95, step  # float sums differ near ties only
        for d, s in sources.items():
            s.observe(q.to(d), ids, fresh[ids].to(d))
    # h itself drifts apart: Adam normalises the outer layer's near-zero first gradients, so float noise moves it
    # by whole steps. What h is for, the corrected table's agreement with fresh encodings, must match.
    q = torch.randn(512, 32, generator=gen)
    kl = {d: float(truncated_kl(q, fresh, s.corrected().cpu())) for d, s in sources.items()}
    assert kl["cpu"] < 0.9 * float(truncated_kl(q, fresh, stale)), kl
    assert kl["cuda"] == pytest.approx(kl["cpu"], rel=0.05), kl
    # a checkpoint written on the GPU, read as xc/run/checkpoint.py reads it, resumes a CPU source
    buffer = io.BytesIO()
    torch.save(sources["cuda"].state_dict(), buffer)
    buffer.seek(0)
    sources["cpu"].load_state_dict(torch.load(buffer, map_location="cpu", weights_only=True))
    torch.testing.assert_close(sources["cpu"].corrected(), sources["cuda"].corrected().cpu())
