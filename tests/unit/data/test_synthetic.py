"""Synthetic generator: power law, determinism, oracle, learnability, streaming, caching."""

from __future__ import annotations

import os
import time
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

import xc.data.synthetic as synth
from xc.data import generate_synthetic, label_signatures, load_dataset, open_dataset
from xc.errors import ConfigError

SMALL = dict(num_train=3000, num_test=1000, num_labels=500, num_features=3000, seed=1)


def arrays(ds):
    out = []
    for split in (ds.train, ds.test):
        for m in (split.labels, split.features):
            out += [np.array(m.indptr), np.array(m.indices)] + ([] if m.values is None else [np.array(m.values)])
    return out


def test_deterministic_for_a_seed_and_different_across_seeds(tmp_path):
    a = generate_synthetic(str(tmp_path / "a"), **SMALL)
    b = generate_synthetic(str(tmp_path / "b"), **SMALL)
    c = generate_synthetic(str(tmp_path / "c"), **dict(SMALL, seed=2))
    for x, y in zip(arrays(a), arrays(b)):
        np.testing.assert_array_equal(x, y)
    assert a.meta["oracle_p1"] == b.meta["oracle_p1"]
    assert not np.array_equal(np.array(a.train.labels.indices), np.array(c.train.labels.indices))


def test_csr_is_canonical(tmp_path):
    ds = generate_synthetic(str(tmp_path), **SMALL)
    for split in (ds.train, ds.test):
        for m, n in ((split.labels, ds.num_labels), (split.features, ds.num_features)):
            s = m.to_scipy()
            assert s.has_canonical_format and s.shape[1] == n and m.indices.max() < n
        assert (np.asarray(split.features.values) >= 1).all()  # term counts
    assert ds.train.labels.values is None and ds.train.features.values.dtype == np.float32


@pytest.mark.parametrize("alpha", [0.7, 1.2])
def test_label_frequencies_follow_the_requested_power_law(tmp_path, alpha):
    ds = generate_synthetic(str(tmp_path), num_train=30000, num_test=100, num_labels=3000, num_features=2000,
                            avg_labels=3, zipf_alpha=alpha, label_noise=0.0, background_features=0, seed=4)
    freq = np.sort(ds.train.labels.column_counts())[::-1]
    ranks = np.arange(1, 501)
    slope = np.polyfit(np.log(ranks), np.log(freq[:500]), 1)[0]
    assert abs(slope + alpha) < 0.1, slope


def test_oracle_p1_matches_label_noise(tmp_path):
    clean = generate_synthetic(str(tmp_path / "a"), **dict(SMALL, label_noise=0.0))
    assert clean.meta["oracle_p1"] == 100.0  # every point keeps all its generating labels
    assert (clean.test.labels.row_lengths() >= 1).all()
    noisy = generate_synthetic(str(tmp_path / "b"), **dict(SMALL, label_noise=0.3, num_test=4000))
    assert abs(noisy.meta["oracle_p1"] - 70.0) < 2.5  # 4000 Bernoulli(0.7): sd ~0.7 points
    assert noisy.meta["oracle_p1_expected"] == 70.0
    assert noisy.meta["oracle_p1"] >= noisy.meta["oracle_p3"] * 0.5
    # No learner beats the oracle by much: even the observed labels' own popularity ranking is worse.
    top = np.argmax(noisy.train.labels.column_counts())
    assert 100 * np.mean(noisy.test.labels.to_scipy()[:, top].toarray()) < noisy.meta["oracle_p1"]
    assert noisy.meta["generator"]["label_noise"] == 0.3


def test_observed_labels_carry_their_signatures(tmp_path):
    ds = generate_synthetic(str(tmp_path), **dict(SMALL, signature_keep=1.0, signature_size=5))
    rows = np.arange(0, 3000, 37)
    for r in rows:
        labels, _ = ds.train.labels.row(int(r))
        feats = set(ds.train.features.row(int(r))[0].tolist())
        sig = label_signatures(np.asarray(labels), 1, 5, ds.num_features)
        assert all(set(s.tolist()) <= feats for s in sig)


def test_bag_of_words_linear_model_gets_close_to_the_oracle(tmp_path):
    ds = generate_synthetic(str(tmp_path), num_train=8000, num_test=2000, num_labels=1000,
                            num_features=5000, seed=3)
    x, y = ds.train.features.to_scipy(), ds.train.labels.to_scipy()
    idf = np.log(x.shape[0] / (1.0 + np.bincount(x.indices, minlength=x.shape[1]))).astype(np.float32)

    def prep(m):
        m = m.copy()
        m.data = np.log1p(m.data)
        m = m @ sp.diags(idf)
        return sp.diags(1 / (np.sqrt(m.multiply(m).sum(1)).A1 + 1e-9)) @ m

    w = y.T @ prep(x)  # label centroids: a linear classifier over the bag of words
    w = sp.diags(1 / (np.sqrt(w.multiply(w).sum(1)).A1 + 1e-9)) @ w
    top = np.asarray((prep(ds.test.features.to_scipy()) @ w.T).argmax(1)).ravel()
    p1 = 100 * np.asarray(ds.test.labels.to_scipy()[np.arange(len(top)), top]).mean()
    assert 0.85 * ds.meta["oracle_p1"] < p1 <= ds.meta["oracle_p1"] + 3


def test_generation_streams_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "_BLOCK_ENTRIES", 1 << 17)  # small blocks keep the test quick
    params = dict(num_test=10, num_labels=2000, num_features=4000, background_features=5, seed=5)
    block = synth.block_points(synth.normalize_params(params))
    peaks = []
    for k, n in enumerate((2 * block, 6 * block)):
        os.makedirs(tmp_path / str(k))
        tracemalloc.start()
        synth.write_synthetic(str(tmp_path / str(k)), dict(params, num_train=n))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0], peaks  # tripling the points must not raise the peak


def test_million_labels_generation_is_fast(tmp_path):
    t = time.perf_counter()
    ds = generate_synthetic(str(tmp_path), num_train=100_000, num_test=10_000, num_labels=1_000_000,
                            num_features=100_000)
    assert time.perf_counter() - t < 30
    assert ds.num_labels == 1_000_000 and ds.train.num_points == 100_000
    assert ds.train.labels.indices.max() < 1_000_000


def test_load_dataset_synthetic_caches_by_parameters(tmp_path, monkeypatch):
    cache = str(tmp_path / "c")
    a = load_dataset("synthetic", None, cache, SMALL)
    b = load_dataset("synthetic", None, cache, dict(SMALL, num_labels=400))
    assert a.meta["cache_dir"] != b.meta["cache_dir"] and b.num_labels == 400
    import xc.data.cache as cache_mod

    monkeypatch.setattr(cache_mod, "write_synthetic", lambda *a: pytest.fail("regenerated"))
    again = load_dataset("synthetic", None, cache, dict(SMALL, seed=1.0))  # same parameters, normalised
    assert again.meta["cache_dir"] == a.meta["cache_dir"]
    assert load_dataset("synthetic", a.meta["cache_dir"], cache).num_labels == 500  # a generated dir


def test_bad_parameters_and_foreign_out_dir(tmp_path):
    for bad in ({"zipf_alpha": -1}, {"label_noise": 1.0}, {"num_labels": 0}, {"bogus": 1}, {"num_train": 2.5}):
        with pytest.raises(ConfigError):
            synth.normalize_params(bad)
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError):
        generate_synthetic(str(tmp_path), **SMALL)
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    out = tmp_path / "ds"
    generate_synthetic(str(out), **SMALL)
    generate_synthetic(str(out), **dict(SMALL, num_labels=300))  # a generated dir is replaced
    assert open_dataset(str(out)).num_labels == 300


def test_label_families_share_their_first_slots_and_only_those(tmp_path):
    """family_size 4, family_shared 5 of 8: siblings (same label // 4) share slots 0-4, never slots 5-7; a
    generated point carries its labels' family signatures; the default parameters keep their cache key."""
    import hashlib
    import json

    from xc.data.synthetic import _BLOCK_ENTRIES, GENERATOR_VERSION, normalize_params, synthetic_key

    sig = label_signatures(np.arange(16), 1, 8, 100_000, family_size=4, family_shared=5)
    for a in range(16):
        for b in range(16):
            if a // 4 == b // 4:
                np.testing.assert_array_equal(sig[a, :5], sig[b, :5])
            else:
                assert not set(sig[a, :5]) & set(sig[b, :5])
            if a != b:
                assert not set(sig[a, 5:]) & set(sig[b, 5:])
    np.testing.assert_array_equal(label_signatures(np.arange(16), 1, 8, 100_000)[:, 5:], sig[:, 5:])
    ds = generate_synthetic(str(tmp_path), **dict(SMALL, signature_keep=1.0, family_size=4, family_shared=5))
    for r in range(0, 3000, 101):
        labels, _ = ds.train.labels.row(r)
        feats = set(ds.train.features.row(r)[0].tolist())
        assert all(set(s.tolist()) <= feats for s in label_signatures(np.asarray(labels), 1, 8, ds.num_features, 4, 5))
    old = {k: v for k, v in normalize_params(SMALL).items()
           if k not in ("family_size", "family_shared", "xor_pairs", "family_adjacent")}
    blob = json.dumps({"v": GENERATOR_VERSION, "b": _BLOCK_ENTRIES, "p": old}, sort_keys=True)
    assert synthetic_key(SMALL) == hashlib.sha256(blob.encode()).hexdigest()
    assert synthetic_key(dict(SMALL, family_size=4, family_shared=5)) != synthetic_key(SMALL)
    with pytest.raises(ConfigError, match="synthetic.family_shared"):
        normalize_params(dict(SMALL, family_size=4, family_shared=8))


def test_xor_twins_share_every_features_rate_and_differ_only_in_which_halves_co_occur(tmp_path):
    """xor_pairs: label 2m emits A+B or A'+B', label 2m+1 A+B' or A'+B (four halves of pair m): each point
    carries one of its label's two variants, and both twins emit each half of their pair at the same rate."""
    from xc.data.synthetic import normalize_params, synthetic_key, xor_signatures

    sig = {(lab, c): set(xor_signatures(np.array([lab]), np.array([c]), 1, 8, 100_000)[0].tolist())
           for lab in (6, 7) for c in (0, 1)}
    halves = {name: set(xor_signatures(np.array([6]), np.array([c]), 1, 8, 100_000)[0, part].tolist())
              for name, c, part in (("A", 0, slice(0, 4)), ("A'", 1, slice(0, 4)), ("B", 0, slice(4, 8)),
                                    ("B'", 1, slice(4, 8)))}
    assert sig[6, 0] == halves["A"] | halves["B"] and sig[6, 1] == halves["A'"] | halves["B'"]
    assert sig[7, 0] == halves["A"] | halves["B'"] and sig[7, 1] == halves["A'"] | halves["B"]
    assert not sig[6, 0] & sig[6, 1]  # the two variants of a label share no feature
    assert not sig[6, 0] & set(xor_signatures(np.array([8]), np.array([0]), 1, 8, 100_000)[0].tolist())  # pair 4

    params = dict(num_train=4000, num_test=10, num_labels=2, num_features=1000, avg_labels=1.0, zipf_alpha=0.0,
                  label_noise=0.0, signature_keep=1.0, background_features=0.0, seed=1, xor_pairs=1)
    ds = generate_synthetic(str(tmp_path), **params)
    x, y = ds.train.features.to_scipy().tocsc(), ds.train.labels.to_scipy().toarray()
    variants = {lab: [xor_signatures(np.array([lab]), np.array([c]), 1, 8, 1000)[0] for c in (0, 1)]
                for lab in (0, 1)}
    for r in range(0, 4000, 97):
        lab = int(np.flatnonzero(y[r])[0])
        feats = set(ds.train.features.row(r)[0].tolist())
        assert feats in ({int(f) for f in variants[lab][0]}, {int(f) for f in variants[lab][1]})
    present = (x > 0).toarray()
    for f in sorted(set(np.concatenate(variants[0] + variants[1]).tolist())):
        rate0, rate1 = present[y[:, 0] > 0, f].mean(), present[y[:, 1] > 0, f].mean()
        assert abs(rate0 - rate1) < 0.06, (f, rate0, rate1)  # 0.5 each, about 2,000 points a twin
    assert synthetic_key(dict(SMALL, xor_pairs=1)) != synthetic_key(SMALL)
    for bad in (dict(xor_pairs=2), dict(xor_pairs=1, signature_size=1), dict(xor_pairs=1, family_size=4,
                                                                                family_shared=2)):
        with pytest.raises(ConfigError, match="synthetic.xor_pairs"):
            normalize_params(dict(SMALL, **bad))


def test_xor_twins_defeat_a_linear_model_and_not_a_neighbour_vote(tmp_path):
    """The non-linear family's point: a ridge regression over the features (the best linear scorer in the
    least-squares sense) ranks a point's twin first about half the time; a 1-nearest-neighbour vote, which
    sees which halves co-occur, gets the oracle."""
    ds = generate_synthetic(str(tmp_path), num_train=6000, num_test=1500, num_labels=40, num_features=2000,
                            avg_labels=1.0, zipf_alpha=0.0, label_noise=0.0, signature_keep=1.0,
                            background_features=0.0, seed=2, xor_pairs=1)
    x, y = ds.train.features.to_scipy().toarray(), ds.train.labels.to_scipy().toarray()
    xt, yt = ds.test.features.to_scipy().toarray(), ds.test.labels.to_scipy().toarray()
    x1, xt1 = np.hstack([x, np.ones((len(x), 1))]), np.hstack([xt, np.ones((len(xt), 1))])
    w = np.linalg.solve(x1.T @ x1 + 1e-2 * np.eye(x1.shape[1]), x1.T @ y)
    linear_p1 = 100 * yt[np.arange(len(yt)), (xt1 @ w).argmax(1)].mean()
    norm = lambda m: m / np.linalg.norm(m, axis=1, keepdims=True)  # noqa: E731
    nearest = (norm(xt) @ norm(x).T).argmax(1)
    knn_p1 = 100 * yt[np.arange(len(yt)), y[nearest].argmax(1)].mean()
    assert ds.meta["oracle_p1"] == 100.0
    assert 40 < linear_p1 < 60 and knn_p1 > 99, (linear_p1, knn_p1)


def test_xor_twins_are_equally_popular_and_pairs_follow_the_power_law(tmp_path):
    ds = generate_synthetic(str(tmp_path), num_train=20000, num_test=10, num_labels=200, num_features=2000,
                            avg_labels=1.0, zipf_alpha=1.0, seed=4, xor_pairs=1)
    counts = np.bincount(ds.train.labels.to_scipy().indices, minlength=200).astype(float)
    pairs = counts[0::2] + counts[1::2]
    head = np.argsort(-pairs)[:10]  # the ten most popular pairs: about 4,000 points over both twins' 20 labels
    share = counts[0::2][head] / pairs[head]
    assert np.all(np.abs(share - 0.5) < 0.08), share
    assert pairs[head[0]] > 5 * np.median(pairs)  # Zipf over the pairs


def test_adjacent_families_take_adjacent_popularity_ranks(tmp_path):
    """family_adjacent: family f's members hold F adjacent ranks (member m of the family at rank F r_f + m), so
    siblings are drawn about as often as each other; without it, a head label's siblings are spread over the
    ranks. Counted on generated data: the label counts of a head family's members against the spread default."""
    from xc.data.synthetic import _adjacent_family_ranks, normalize_params, synthetic_key

    ranks = _adjacent_family_ranks(20, 8, np.random.default_rng(0))
    assert sorted(ranks.tolist()) == list(range(20))  # a permutation of the labels
    families = ranks[:16].reshape(2, 8)
    for fam in families:  # each block of 8 ranks is one family, its members in order
        assert (fam // 8 == fam[0] // 8).all() and (np.diff(fam) == 1).all()
    assert ranks[16:].tolist() == [16, 17, 18, 19]  # the partial family keeps the last ranks

    params = dict(SMALL, num_labels=512, family_size=16, family_shared=6, label_noise=0.0)
    adjacent = generate_synthetic(str(tmp_path / "a"), **dict(params, family_adjacent=1))
    spread = generate_synthetic(str(tmp_path / "s"), **params)

    def family_spread(ds):
        """max / min label count within the family of the most popular label (counts + 1)."""
        counts = np.bincount(np.asarray(ds.train.labels.indices), minlength=512) + 1
        head = int(np.argmax(counts)) // 16
        members = counts[head * 16:(head + 1) * 16]
        return members.max() / members.min()

    assert family_spread(adjacent) < 20 < family_spread(spread)  # Zipf 1 over 16 adjacent ranks: 16x at most
    assert synthetic_key(dict(params, family_adjacent=1)) != synthetic_key(params)
    with pytest.raises(ConfigError, match="synthetic.family_adjacent"):
        normalize_params(dict(SMALL, family_adjacent=1))  # family_size 1: no family to place


@pytest.mark.parametrize("extra", [{}, {"xor_pairs": 1}, {"family_size": 4, "family_shared": 3}])
def test_generating_labels_are_the_observed_ones_and_those_the_noise_dropped(tmp_path, monkeypatch, extra):
    """`generating_labels` redraws both splits without the features: its kept labels are exactly the stored
    labels of every point (a block boundary included: 3,000 points span blocks), its dropped share is about
    label_noise, and its most popular kept label per point reproduces the generator's oracle P@1."""
    params = dict(SMALL, **extra)
    monkeypatch.setattr(synth, "_BLOCK_ENTRIES", 1 << 14)  # blocks of 1,024 points
    ds = generate_synthetic(str(tmp_path), **params)
    assert synth.block_points(synth.normalize_params(params)) < params["num_train"]
    for split, stored in (("train", ds.train), ("test", ds.test)):
        g = synth.generating_labels(params, split)
        indptr, labels, kept = g["indptr"], g["labels"], g["kept"]
        assert len(indptr) == stored.num_points + 1
        for i in range(stored.num_points):
            row = slice(indptr[i], indptr[i + 1])
            assert np.all(np.diff(g["ranks"][row]) > 0)  # most popular first, no repeats
            np.testing.assert_array_equal(np.sort(labels[row][kept[row]]), stored.labels.row(i)[0])
        assert abs(1 - kept.mean() - 0.1) < 0.02
    first_kept = [bool(kept[indptr[i]]) for i in range(ds.test.num_points)]
    assert round(100 * np.mean(first_kept), 4) == ds.meta["oracle_p1"]
    with pytest.raises(ConfigError, match="split"):
        synth.generating_labels(params, "valid")
