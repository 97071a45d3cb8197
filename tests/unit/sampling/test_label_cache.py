"""Label-embedding cache sources: refresh policies encode exactly what they count, mining is exact top-k,
the target corrector learns a drift and respects its stop-gradients (xc/sampling/label_cache.py, corrector.py)."""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest
import torch

from xc.config import SamplerConfig
from xc.sampling.cache_registry import CacheSpec, build_cache_source, cache_source_names
from xc.sampling.corrector import truncated_kl
from xc.sampling.label_cache import block_max_topk, chunked_topk


def _spec(tmp_path, name="lf_stale", n=40, dim=8, **over) -> tuple[str, CacheSpec]:
    cfg = dataclasses.replace(SamplerConfig(name=name), **over)
    return name, CacheSpec(cfg, 0, 0, n, dim, str(tmp_path / "cache" / "shard0.npy"), seed=3)


class RecordingEncoder:
    """encode(ids) -> rows that depend on (id, call number), remembering every id asked for."""

    def __init__(self, dim: int):
        self.dim, self.calls, self.asked = dim, 0, []

    def __call__(self, ids: np.ndarray) -> torch.Tensor:
        self.calls += 1
        self.asked.append(np.asarray(ids).copy())
        return torch.tensor(ids, dtype=torch.float32).unsqueeze(1).repeat(1, self.dim) + 1000.0 * self.calls


def _run(source, enc, steps):
    return [source.refresh(step, enc) for step in steps]


def test_builtin_sources_registered():
    assert {"lf_stale", "lf_exhaustive", "lf_partial", "corrector"} <= set(cache_source_names())


def test_stale_encodes_every_label_once(tmp_path):
    source = build_cache_source(*_spec(tmp_path, "lf_stale"))
    enc = RecordingEncoder(8)
    done = _run(source, enc, range(20))
    # A policy that re-encoded (or never encoded) would count differently from n.
    assert done == [40] + [0] * 19 and source.encodings == 40
    assert sorted(np.concatenate(enc.asked).tolist()) == list(range(40))
    assert torch.equal(source.cache.tensor()[:, 0], torch.arange(40).float() + 1000.0)


def test_exhaustive_reencodes_everything_every_w_steps(tmp_path):
    source = build_cache_source(*_spec(tmp_path, "lf_exhaustive", cache_refresh_every=3))
    enc = RecordingEncoder(8)
    done = _run(source, enc, range(10))
    assert [s for s, d in enumerate(done) if d] == [0, 3, 6, 9] and all(d in (0, 40) for d in done)
    assert source.encodings == 4 * 40 == sum(len(a) for a in enc.asked)
    assert source.refresh(9, enc) == 0  # a second call in the same step (grad accumulation) encodes nothing
    last = enc.calls
    assert torch.all(source.cache.tensor()[:, 0] >= 1000.0 * last - 1)  # the cache holds the newest encodings


@pytest.mark.parametrize("fraction", [0.3, 0.25, 1.0, 0.07])
def test_partial_covers_all_rows_in_ceil_one_over_fraction_refreshes(tmp_path, fraction):
    n = 40
    source = build_cache_source(*_spec(tmp_path, "lf_partial", n=n, cache_refresh_every=2, cache_partial_fraction=fraction))
    enc = RecordingEncoder(8)
    assert source.refresh(0, enc) == n  # the initial full build
    per = math.ceil(fraction * n)
    needed = math.ceil(1 / fraction)
    seen: set[int] = set()
    refreshes = 0
    for step in range(1, 2 * needed + 1):
        done = source.refresh(step, enc)
        if step % 2:
            assert done == 0
            continue
        refreshes += 1
        assert done == per
        # oldest first: every row refreshed now was encoded no later than every row left alone
        ids = enc.asked[-1]
        others = np.setdiff1d(np.arange(n), ids)
        if refreshes <= needed - 1 and len(others):
            assert source.cache.encoded_at[others].max() <= step
        seen.update(ids.tolist())
        if refreshes == needed:
            assert seen == set(range(n)), f"{len(seen)} of {n} rows after {needed} refreshes"
    assert source.encodings == n + refreshes * per


def test_state_dict_round_trip_restores_cache_and_counters(tmp_path):
    source = build_cache_source(*_spec(tmp_path, "lf_partial", cache_refresh_every=1, cache_partial_fraction=0.25))
    enc = RecordingEncoder(8)
    _run(source, enc, range(3))
    state = source.state_dict()
    other = build_cache_source(*_spec(tmp_path / "b", "lf_partial", cache_refresh_every=1, cache_partial_fraction=0.25))
    other.load_state_dict(state)
    assert other.encodings == source.encodings and other.cursor == source.cursor
    assert torch.equal(other.cache.tensor(), source.cache.tensor())
    a, b = RecordingEncoder(8), RecordingEncoder(8)
    assert source.refresh(3, a) == other.refresh(3, b) and np.array_equal(a.asked[0], b.asked[0])


def test_chunked_topk_equals_brute_force():
    gen = torch.Generator().manual_seed(0)
    q, table = torch.randn(9, 6, generator=gen), torch.randn(103, 6, generator=gen)
    for chunk in (7, 50, 1000):
        scores, ids = chunked_topk(q, table, 10, chunk)
        ref = torch.topk(q @ table.t(), 10, dim=1)
        torch.testing.assert_close(scores, ref.values)
        assert torch.equal(ids, ref.indices)


def test_block_max_topk_equals_torch_topk():
    gen = torch.Generator().manual_seed(3)
    for n, k in ((1000, 3), (1024, 5), (4000, 16), (130, 16), (50, 80)):  # ragged tail, exact blocks, k > n
        scores = torch.randn(7, n, generator=gen)
        scores[0, :] = scores[0, 5]  # a row of ties: the values must still agree
        best, cols = block_max_topk(scores, k)
        ref = torch.topk(scores, min(k, n), dim=1)
        torch.testing.assert_close(best, ref.values)
        assert torch.equal(cols[1:], ref.indices[1:])
        assert torch.equal(scores.gather(1, cols), best) and all(len(set(r.tolist())) == r.numel() for r in cols)


def test_mining_is_exact_top_k_of_the_cache_and_of_the_corrected_cache(tmp_path):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(77, 8, generator=gen)
    q = torch.randn(5, 8, generator=gen)
    for name in ("lf_stale", "corrector"):
        source = build_cache_source(*_spec(tmp_path / name, name, n=77, cache_mine_chunk=10))
        source.refresh(0, lambda ids: rows[torch.from_numpy(ids)])
        if name == "corrector":  # a non-identity h, so corrected and plain top-k differ
            with torch.no_grad():
                for p in source.h.parameters():
                    p.normal_(0.0, 0.5, generator=gen)
            target = source.h(rows).detach()
            assert not torch.equal(torch.topk(q @ target.t(), 6).indices, torch.topk(q @ rows.t(), 6).indices)
        else:
            target = rows
        ids, log_q = source.mine(q, 6, gen)
        assert log_q is None
        assert torch.equal(ids, torch.topk(q @ target.t(), 6, dim=1).indices)


def _drift_setup(n=200, d=16, seed=0):
    """A stale cache B and fresh encodings G = B + r(B), r a random residual 2-layer MLP (002 sec. 8.2)."""
    gen = torch.Generator().manual_seed(seed)
    stale = torch.randn(n, d, generator=gen)
    w1, w2 = torch.randn(d, 64, generator=gen) / d ** 0.5, torch.randn(64, d, generator=gen) / 8.0
    fresh = stale + torch.relu(stale @ w1) @ w2
    return gen, stale, fresh


@pytest.mark.parametrize("train", [True, False])
def test_corrector_learns_a_residual_drift(tmp_path, train):
    gen, stale, fresh = _drift_setup()
    source = build_cache_source(*_spec(tmp_path, "corrector", n=200, dim=16, corrector_hidden=64, corrector_lr=3e-3))
    source.refresh(0, lambda ids: stale[torch.from_numpy(ids)])
    for _ in range(300 if train else 0):
        q = torch.randn(32, 16, generator=gen)
        ids = torch.randperm(200, generator=gen)[:64]
        source.observe(q, ids, fresh[ids])
    q = torch.randn(256, 16, generator=gen)  # held-out queries, the whole shard as S
    kl_stale = float(truncated_kl(q, fresh, stale))
    kl_fixed = float(truncated_kl(q, fresh, source.corrected()))
    assert kl_stale > 0.1, "the drift is too small to test anything"
    # An untrained corrector is the identity (its KL equals the stale cache's): the parametrisation with
    # train=False checks that this assertion really rejects it.
    if train:
        assert kl_fixed < 0.25 * kl_stale, (kl_fixed, kl_stale)
    else:
        assert kl_fixed == pytest.approx(kl_stale, rel=1e-5)


def test_corrector_loss_leaves_the_towers_untouched(tmp_path):
    _, stale, fresh = _drift_setup(n=50)
    source = build_cache_source(*_spec(tmp_path, "corrector", n=50, dim=16))
    source.refresh(0, lambda ids: stale[torch.from_numpy(ids)])
    f = torch.nn.Linear(16, 16)
    g = torch.nn.Linear(16, 16)
    q = f(torch.randn(8, 16))  # carries autograd history into f
    ids = torch.arange(20)
    fresh_emb = g(fresh[ids])  # ... and into g
    before = [p.detach().clone() for p in source.h.parameters()]
    source.observe(q, ids, fresh_emb)
    assert all(p.grad is None for p in [*f.parameters(), *g.parameters()])
    assert any(not torch.equal(a, b) for a, b in zip(before, source.h.parameters()))  # h did learn


def test_task_loss_leaves_the_corrector_untouched(tmp_path):
    from xc.train.modes.dual.step import draw_dual_candidates, dual_loss
    from xc.models.towers import TokenBagTower
    from xc.sampling import StepKey, draw_positives
    from xc.shards import ShardLayout

    layout = ShardLayout.build(60, 1, 4)
    tower = TokenBagTower(30, 16, [], 0.0)
    texts = torch.randint(1, 30, (60, 5), generator=torch.Generator().manual_seed(0))

    def label_inputs(ids):
        ids = torch.as_tensor(ids)
        return {"input_ids": texts[ids], "attention_mask": torch.ones_like(texts[ids])}

    source = build_cache_source(*_spec(tmp_path, "corrector", n=60, dim=16))
    source.refresh(0, lambda ids: tower(label_inputs(ids)).detach())
    q = torch.randn(4, 16, requires_grad=True)
    key = StepKey(0, 0, 0)
    pos = draw_positives(np.array([0, 1, 2, 3, 4]), np.array([3, 7, 9, 11]), 2, layout.padded_labels, key.generator(-1))
    cand = draw_dual_candidates(layout, range(1), {0: source}, q.detach(), key, pos, 4, 8, 0, layout.padded_labels)
    res = dual_loss(tower, label_inputs, None, q, cand, pos, "softmax", 4.0, None, 0)
    res.loss.backward()
    assert q.grad is not None and tower.bag.weight.grad is not None  # the task loss trains f and g ...
    assert all(p.grad is None for p in source.h.parameters())  # ... and never h


def test_corrector_mining_from_a_periodic_table_resumes_exactly(tmp_path):
    """corrector_mine_every=3: mining reads h(B) as of the last update at a multiple of 3 (a table that lags h,
    not h itself), and a source restored from a state written between two rebuilds mines the very same ids."""
    gen, stale, fresh = _drift_setup(n=120, d=16)
    over = dict(n=120, dim=16, corrector_hidden=32, corrector_lr=3e-2, corrector_mine_every=3)
    source = build_cache_source(*_spec(tmp_path / "a", "corrector", **over))
    source.refresh(0, lambda ids: stale[torch.from_numpy(ids)])
    q_test = torch.randn(16, 16, generator=gen)
    for step in range(5):
        source.mine(q_test, 5, gen)  # builds the table at updates 0 and 3, as a training run would
        ids = torch.randperm(120, generator=gen)[:40]
        source.observe(torch.randn(8, 16, generator=gen), ids, fresh[ids])
    assert source.steps == 5 and source.table_at == 3
    lagging, _ = source.mine(q_test, 5, gen)
    assert torch.equal(lagging, torch.topk(q_test @ source.table.t(), 5, dim=1).indices)
    assert not torch.equal(source.table, source.corrected()), "h moved on since the table was made"
    restored = build_cache_source(*_spec(tmp_path / "b", "corrector", **over))
    buffer = io.BytesIO()  # through a checkpoint file: the state must not share tensors with the live source
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.mine(q_test, 5, gen)[0], lagging)
    ids = torch.randperm(120, generator=gen)[:40]  # update 6: both rebuild from the h they now hold
    for s in (source, restored):
        s.observe(q_test[:8], ids, fresh[ids])
    assert torch.equal(restored.mine(q_test, 5, gen)[0], source.mine(q_test, 5, gen)[0])



def test_corrector_trains_on_positives_and_mined_ids_plus_a_seeded_sample(tmp_path):
    """corrector_max_others=m: h trains on the step's positives and the ids the last mine() returned, plus m of
    the other scored labels, drawn by (seed, shard, update): the same sample on any world size and on resume."""
    _, stale, fresh = _drift_setup(n=100)
    source = build_cache_source(*_spec(tmp_path, "corrector", n=100, dim=16, corrector_max_others=10))
    source.refresh(0, lambda ids: stale[torch.from_numpy(ids)])
    mined, _ = source.mine(torch.randn(4, 16), 3, torch.Generator())
    sampled = torch.arange(0, 100, 2)  # the step scored 50 labels
    positives = torch.tensor([4, 10, 98])
    pick = source._training_targets(sampled, positives)
    chosen = set(sampled[pick].tolist())
    must = set(positives.tolist()) | (set(mined.flatten().tolist()) & set(sampled.tolist()))
    assert must <= chosen and len(chosen) == len(must) + 10 and torch.equal(pick, torch.sort(pick).values)
    assert torch.equal(pick, source._training_targets(sampled, positives))  # the same update: the same sample
    source.steps += 1
    assert not torch.equal(pick, source._training_targets(sampled, positives))
    off = build_cache_source(*_spec(tmp_path / "off", "corrector", n=100, dim=16))
    assert torch.equal(off._training_targets(sampled, positives), torch.arange(50))  # 0: every scored label
