"""SG tree (a cover tree with sibling-only separation) over Nystrom target features ("Improving Dual-Encoder Training through Dynamic Indexes for Negative Mining", §2.3, §2.8, §9).

Distance d(a, b) = exp(-phi_a·phi_b) (not a metric: d(a, a) = exp(-|phi_a|²) != 0), base b = 1.05.
Every target is exactly one node (no self-nesting, as in the public NysSG code), so node id == point id:
    level[v]   integer level ℓ, covering radius b^ℓ; children sit at a lower level (usually ℓ-1;
               a promoted root may leave a gap, which the invariants below allow)
    parent[v]  -1 for the root, -2 for a point not (yet) in the tree
    maxd[v]    max distance from v to any descendant, mind[v] min distance between two children of v
    size[v]    1 + number of descendants; start[v] its position in the DFS order, so the cluster
               {v} ∪ desc(v) is the contiguous slice order[start[v] : start[v] + size[v]]
Invariants (`check_covering`): d(parent, v) <= b^level[parent] and level[v] < level[parent] for every
non-root node; the DFS layout reaches every point of the tree once. Siblings are separated at insertion
(d > b^level(child)); drift may break that, and `violations` reports it, but sampling does not need it.

Construction. `insert` is §9's algorithm: descend from the root into the nearest child while p lies in
that child's covering ball, else attach p as a new child one level down; the root is promoted when p is
outside its ball. Bulk `build` (and every rebuild) is its vectorised top-down equivalent: under a node
v at level ℓ, the not-yet-assigned point most similar to v becomes a child at ℓ-1 and takes every
remaining point within b^(ℓ-1) of it; repeat, then recurse. One numpy mat-vec per created node, so a
full build of n points costs n small mat-vecs instead of n root-to-leaf Python walks (measured in
docs/dynamic_tree.md). The result satisfies the same covering and sibling-separation invariants.

Maintenance (§2.8). `rebuild_below(r)` is the practical form of Algorithm 3: every topmost node at level
<= r keeps its place and its subtree is rebuilt under it; points that drifted out of that node's ball
are re-inserted from the root; edges above r that drift broke (checked vectorised) escalate to a rebuild
of the topmost violating parent's subtree, and a root that no longer covers its children is promoted.
So `check_covering()` holds after any drift + rebuild_below, whatever r. `rebuild()` is the full rebuild.
"""

from __future__ import annotations

import math

import numpy as np

def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) over pairs, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(total)


_MIN_LEVEL = -400  # below this every point of a set becomes its own child (only duplicates get here)
_ABSENT = -2


class SGTree:
    """SG tree over the rows of `points` (n, d') float32; the array is referenced, not copied, so
    in-place updates of the cache are seen (call `rebuild_below`/`rebuild` after they happen)."""

    def __init__(self, points: np.ndarray, base: float = 1.05):
        if base <= 1.0:
            raise ValueError(f"tree base must be > 1, got {base}")
        self.pts, self.base = points, float(base)
        n = points.shape[0]
        self.n = n
        self.parent = np.full(n, _ABSENT, dtype=np.int64)
        self.level = np.zeros(n, dtype=np.int32)
        self.children: list[list[int]] = [[] for _ in range(n)]
        self.maxd = np.zeros(n, dtype=np.float32)
        self.mind = np.full(n, np.inf, dtype=np.float32)
        self.root = -1
        self._dirty = True

    # ---- helpers ----------------------------------------------------------------------------------
    def dist(self, v: int, others: np.ndarray) -> np.ndarray:
        return np.exp(-(self.pts[others] @ self.pts[v]))

    def _level_for(self, d: float) -> int:
        return int(math.ceil(math.log(max(d, 1e-30), self.base) - 1e-9))

    def members(self) -> np.ndarray:
        return np.flatnonzero(self.parent != _ABSENT)

    # ---- construction -----------------------------------------------------------------------------
    def build(self, ids: np.ndarray | None = None) -> None:
        """Full (re)build over `ids` (default: all points). Root = the point most similar to the mean."""
        ids = np.arange(self.n) if ids is None else np.asarray(ids, dtype=np.int64)
        self.parent[:] = _ABSENT
        for v in range(self.n):
            self.children[v] = []
        if len(ids) == 0:
            self.root = -1
            return
        sub = self.pts[ids]
        self.root = root = int(ids[np.argmax(sub @ sub.mean(0))])
        self.parent[root] = -1
        rest = ids[ids != root]
        self.level[root] = self._level_for(float(self.dist(root, rest).max())) if len(rest) else 0
        self._build_under(root, rest)
        self.finalize()

    def _build_under(self, node: int, ids: np.ndarray) -> None:
        """Greedy top-down construction of the subtree under `node` over `ids` (all within its ball)."""
        stack = [(node, ids)]
        while stack:
            v, rem = stack.pop()
            if len(rem) == 0:
                continue
            lvl = int(self.level[v]) - 1
            sep = self.base ** lvl
            rem = rem[np.argsort(-(self.pts[rem] @ self.pts[v]), kind="stable")]  # most central first
            while len(rem):
                c, rem = int(rem[0]), rem[1:]
                self.parent[c], self.level[c] = v, lvl
                self.children[v].append(c)
                if len(rem) == 0:
                    break
                if lvl <= _MIN_LEVEL:  # degenerate duplicates: flatten instead of descending forever
                    continue
                take = self.dist(c, rem) <= sep
                if take.any():
                    stack.append((c, rem[take]))
                    rem = rem[~take]
        self._dirty = True

    def insert(self, p: int) -> None:
        """§9 insertion of point p (not yet in the tree)."""
        if self.parent[p] != _ABSENT:
            raise ValueError(f"point {p} is already in the tree")
        if self.root < 0:
            self.root, self.parent[p], self.level[p] = p, -1, 0
            self._dirty = True
            return
        d_root = float(self.dist(self.root, np.array([p]))[0])
        if d_root > self.base ** self.level[self.root]:  # promote the root: a larger ball covers p
            self.level[self.root] = self._level_for(d_root)
        v, path = self.root, [self.root]
        while True:
            ch = self.children[v]
            if ch:
                chs = np.asarray(ch)
                d = self.dist(p, chs)
                j = int(np.argmin(d))
                if d[j] <= self.base ** self.level[chs[j]]:
                    v = int(chs[j])
                    path.append(v)
                    continue
            self.parent[p], self.level[p] = v, self.level[v] - 1
            self.children[v].append(p)
            break
        path_arr = np.asarray(path)
        self.maxd[path_arr] = np.maximum(self.maxd[path_arr], self.dist(p, path_arr))
        self._dirty = True

    # ---- layout and statistics --------------------------------------------------------------------
    def finalize(self) -> None:
        """Recompute the DFS layout (order, start, size, CSR children, siblings by id) and maxd/mind,
        vectorised layer by layer (O(depth) numpy passes, no per-node Python)."""
        n = self.n
        self.start = np.full(n, -1, dtype=np.int64)
        self.size = np.zeros(n, dtype=np.int64)
        nodes = self.members()
        kids = nodes[self.parent[nodes] >= 0]
        counts = np.bincount(self.parent[kids], minlength=n)
        self.child_ptr = np.concatenate([[0], np.cumsum(counts)])
        self.child_idx = kids[np.argsort(self.parent[kids], kind="stable")]
        for v in range(n):  # keep the lists the builders edit in the same (by id) order as the CSR
            if self.children[v]:
                self.children[v] = self.child_idx[self.child_ptr[v]:self.child_ptr[v + 1]].tolist()
        layers = [np.array([self.root], dtype=np.int64)] if self.root >= 0 else []
        while layers:  # breadth-first layers; each is grouped by parent in CSR order
            nxt = self.child_idx[_ranges(self.child_ptr[layers[-1]], counts[layers[-1]])]
            if len(nxt) == 0:
                break
            layers.append(nxt)
        self.size[nodes] = 1
        for layer in reversed(layers[1:]):
            np.add.at(self.size, self.parent[layer], self.size[layer])
        if layers:
            self.start[self.root] = 0
        for layer in layers[1:]:  # pre-order start = parent's start + 1 + sizes of earlier siblings
            csum = np.cumsum(self.size[layer])
            par = self.parent[layer]
            first = np.concatenate([[True], par[1:] != par[:-1]])
            group_len = np.diff(np.concatenate([np.flatnonzero(first), [len(layer)]]))
            base = np.repeat((csum - self.size[layer])[first], group_len)
            self.start[layer] = self.start[par] + 1 + (csum - self.size[layer] - base)
        self.order = np.empty(int(self.size[self.root]) if layers else 0, dtype=np.int64)
        reached = nodes[self.start[nodes] >= 0]
        self.order[self.start[reached]] = reached
        self._stats(kids[self.start[kids] >= 0], counts)  # unreached (cyclic) parts have no chain to the root
        self._dirty = False

    def _stats(self, kids: np.ndarray, counts: np.ndarray) -> None:
        """maxd by walking every point's ancestor chain; mind over all sibling pairs."""
        self.maxd[:] = 0.0
        self.mind[:] = np.inf
        v, a = kids, self.parent[kids]
        while len(v):
            np.maximum.at(self.maxd, a, np.exp(-(self.pts[a] * self.pts[v]).sum(1)))
            up = self.parent[a] >= 0
            v, a = v[up], self.parent[a[up]]
        multi = np.flatnonzero((counts > 1) & (self.start >= 0))
        if len(multi):  # pair each child with its later siblings: sum over parents of c(c-1)/2 pairs
            pos = _ranges(self.child_ptr[multi], counts[multi])
            end = np.repeat(self.child_ptr[multi + 1], counts[multi])
            left = np.repeat(pos, end - pos - 1)
            right = _ranges(pos + 1, end - pos - 1)
            i, j = self.child_idx[left], self.child_idx[right]
            np.minimum.at(self.mind, self.parent[i], np.exp(-(self.pts[i] * self.pts[j]).sum(1)))

    def ensure_layout(self) -> None:
        if self._dirty:
            self.finalize()

    # ---- invariants -------------------------------------------------------------------------------
    def violations(self, tol: float = 1e-4) -> dict[str, int]:
        """Counts of broken invariants (0 everywhere for a valid tree)."""
        self.ensure_layout()
        nodes = self.members()
        kids = nodes[self.parent[nodes] >= 0]
        par = self.parent[kids]
        d = np.exp(-(self.pts[kids] * self.pts[par]).sum(1))
        cover = d > (self.base ** self.level[par].astype(np.float64)) * (1 + tol)
        sep = 0
        for v in nodes[self.size[nodes] > 2]:
            ch = self.child_idx[self.child_ptr[v]:self.child_ptr[v + 1]]
            if len(ch) > 1:
                g = np.exp(-(self.pts[ch] @ self.pts[ch].T))
                np.fill_diagonal(g, np.inf)
                sep += int((g * (1 + tol) < self.base ** self.level[ch].astype(np.float64)[:, None]).any(1).sum())
        roots = int((self.parent[nodes] == -1).sum())
        return {"covering": int(cover.sum()), "level_order": int((self.level[kids] >= self.level[par]).sum()),
                "unreached": int(len(nodes) - len(self.order)), "roots": abs(roots - 1) if len(nodes) else 0,
                "separation": sep}

    def check_covering(self, tol: float = 1e-4) -> bool:
        """True iff every parent covers its children at its level and the layout is a single tree."""
        v = self.violations(tol)
        return v["covering"] == 0 and v["level_order"] == 0 and v["unreached"] == 0 and v["roots"] == 0

    # ---- maintenance ------------------------------------------------------------------------------
    def _detach_subtree(self, v: int) -> np.ndarray:
        desc = self.order[self.start[v] + 1:self.start[v] + self.size[v]].copy()
        self.parent[desc] = _ABSENT
        for u in desc:
            self.children[u] = []
        self.children[v] = []
        return desc

    def _rebuild_subtree(self, v: int, outside: list[np.ndarray]) -> None:
        desc = self._detach_subtree(v)
        if len(desc) == 0:
            return
        inside = self.dist(v, desc) <= self.base ** self.level[v]
        self._build_under(v, desc[inside])
        outside.append(desc[~inside])

    def rebuild_below(self, r: int) -> dict[str, int]:
        """Partial rebuild after the points moved: rebuild every subtree rooted at a topmost node of
        level <= r and under every topmost parent above r whose covering drift broke; re-insert the
        points that left their subtree's ball; a root that no longer covers its children is promoted."""
        self.ensure_layout()  # the layout of the tree before this call: every decision is made on it
        nodes = self.members()
        par = self.parent[nodes]
        top = nodes[(self.level[nodes] <= r) & (self.size[nodes] > 1)
                    & ((par < 0) | (self.level[np.maximum(par, 0)] > r))]
        kids = nodes[(par >= 0) & (self.level[np.maximum(par, 0)] > r)]  # edges not rebuilt below r
        kpar = self.parent[kids]
        bad = np.unique(kpar[np.exp(-(self.pts[kids] * self.pts[kpar]).sum(1))
                             > self.base ** self.level[kpar].astype(np.float64)])
        escal = 0
        if self.root in bad:  # the root keeps its children; a larger ball covers them again
            ch = np.asarray(self.children[self.root])
            self.level[self.root] = max(int(self.level[self.root]),
                                        self._level_for(float(self.dist(self.root, ch).max())))
            bad, escal = bad[bad != self.root], 1
        # subtree roots to rebuild: violating parents and top nodes, minus those inside another one
        cand = np.unique(np.concatenate([bad, top]))
        lo, hi = self.start[cand], self.start[cand] + self.size[cand]
        o = np.argsort(lo)
        lo, hi, cand = lo[o], hi[o], cand[o]
        inside = np.zeros(len(cand), dtype=bool)
        reach = -1
        for i in range(len(cand)):  # ranges nest or are disjoint: one sweep finds the outermost
            inside[i] = lo[i] < reach
            reach = max(reach, hi[i]) if not inside[i] else reach
        outside: list[np.ndarray] = []
        for v in cand[~inside]:
            self._rebuild_subtree(int(v), outside)
        escal += int(np.isin(cand[~inside], bad).sum())
        out = np.concatenate(outside) if outside else np.array([], dtype=np.int64)
        for p in out:
            self.insert(int(p))
        self.finalize()
        return {"subtrees": int((~inside).sum()), "escalations": escal, "reinserted": int(len(out))}

    def rebuild(self) -> None:
        """Full rebuild over the current members."""
        self.build(self.members())

    def state_dict(self) -> dict:
        """The structure (parent, level, root, children in order); statistics are recomputed on load."""
        self.ensure_layout()
        return {"parent": self.parent.copy(), "level": self.level.copy(), "root": self.root,
                "child_ptr": self.child_ptr.copy(), "child_idx": self.child_idx.copy()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["parent"]) != self.n:
            raise ValueError(f"tree state for {len(state['parent'])} points, this tree has {self.n}")
        self.parent[:], self.level[:], self.root = state["parent"], state["level"], int(state["root"])
        ptr, idx = state["child_ptr"], state["child_idx"]
        self.children = [idx[ptr[v]:ptr[v + 1]].tolist() for v in range(self.n)]
        self.finalize()

    def memory_bytes(self) -> int:
        """Per-node arrays (parent, level, maxd, mind, start, size, order, CSR children), as int32/float32."""
        return int(self.n * 4 * 9)
