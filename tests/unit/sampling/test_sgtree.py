"""SG tree: the covering invariant holds after build, inserts, drift + partial rebuild and full rebuild,
check_covering rejects broken trees, and the DFS layout makes every cluster a contiguous slice."""

from __future__ import annotations

import numpy as np
import pytest

from xc.sampling.drift_synth import DriftingTargets
from xc.sampling.sgtree import SGTree


def _tree(n=1500, d=16, seed=0, ids=None):
    data = DriftingTargets(n, d, clusters=20, strength=0.5, seed=seed)
    pts = data.fresh0.copy()
    tree = SGTree(pts)
    tree.build(ids)
    return tree, pts, data


def test_build_covers_and_layout_slices_are_subtrees():
    tree, pts, _ = _tree(600)
    assert tree.check_covering()
    assert tree.violations()["separation"] == 0  # greedy build separates siblings at their level
    assert sorted(tree.order.tolist()) == list(range(600))
    rng = np.random.default_rng(0)
    for v in rng.choice(600, 40, replace=False):
        walk = set()  # descendants by walking parent pointers, against the DFS slice
        for u in range(600):
            a = tree.parent[u]
            while a >= 0:
                if a == v:
                    walk.add(u)
                    break
                a = tree.parent[a]
        sl = tree.order[tree.start[v]:tree.start[v] + tree.size[v]]
        assert sl[0] == v and set(sl[1:].tolist()) == walk
        if len(walk):  # maxd is the exact farthest-descendant distance
            assert np.isclose(tree.maxd[v], np.exp(-(pts[list(walk)] @ pts[v])).max(), rtol=1e-5)


def test_inserts_keep_covering_and_separation():
    n = 1200
    tree, _, _ = _tree(n, ids=np.arange(0, n, 2))  # build on half, §9-insert the other half
    for p in range(1, n, 2):
        tree.insert(p)
    tree.finalize()
    assert tree.check_covering()
    assert tree.violations()["separation"] == 0
    assert len(tree.order) == n
    with pytest.raises(ValueError, match="already in the tree"):
        tree.insert(3)


def test_check_covering_rejects_broken_trees():
    tree, pts, _ = _tree(500)
    leaf = int(tree.order[-1])
    parent = int(tree.parent[leaf])
    pts[leaf] = -pts[parent]  # move a point far outside its parent's ball
    assert not tree.check_covering()
    assert tree.violations()["covering"] >= 1
    tree2, _, _ = _tree(500)
    v = int(tree2.order[5])
    tree2.level[v] = tree2.level[tree2.parent[v]]  # a child at its parent's level
    assert not tree2.check_covering()
    tree3, _, _ = _tree(500)
    v = int(next(u for u in tree3.order[1:] if tree3.size[u] > 1))
    tree3.parent[v] = tree3.child_idx[tree3.child_ptr[v]]  # a cycle: v's subtree is cut off from the root
    tree3.finalize()
    assert not tree3.check_covering() and tree3.violations()["unreached"] > 0


@pytest.mark.parametrize("level", [2, -3, -6, -30])
def test_drift_then_rebuild_below_restores_covering(level):
    tree, pts, data = _tree(1500, seed=1)
    before = set(tree.members().tolist())
    pts[:] = data.fresh1  # the target tower moved: the tree's own array is updated in place
    assert not tree.check_covering()  # drift broke it (else this test would prove nothing)
    info = tree.rebuild_below(level)
    assert tree.check_covering(), info
    assert set(tree.members().tolist()) == before and len(tree.order) == len(before)


def test_full_rebuild_after_drift():
    tree, pts, data = _tree(800, seed=2)
    pts[:] = data.fresh1
    tree.rebuild()
    assert tree.check_covering() and tree.violations()["separation"] == 0
