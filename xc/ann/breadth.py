"""How widely an ANN index searches, and the rule that widens it until it finds what exact search finds.

A graph or IVF index walks a candidate list of fixed breadth per query: DiskANN's L_search
(`diskann_search_complexity`), HNSW's efSearch (`hnsw_ef_search`), IVF's nprobe (`ivf_nprobe`). The breadth
that reaches a given recall is not a constant: it grows with the rows' width and count and with how their
directions spread. With DiskANN's L_search = 64, a 128-wide model over 10^6 labels serves at 95.2% of exact
recall@5 and a 512-wide one of the same labels at 70.1% (P@1 86.80 against 88.35 exact; docs/serving.md).

So serving does not trust the configured breadth: `tune_breadth` starts from it and doubles it until recall@k
against exact search, on a probe of the queries being served, reaches `target` (`ann.serve_recall`), at most
`BREADTH_STEPS` doublings. The probe's exact search costs what exact serving of those queries would; once tuned,
every other query is served at the chosen breadth. Where the index at that breadth was no faster a query than the
probe's exact search, serving says so (`BreadthTuning.exact_is_faster`) but keeps the index: the caller chose it, and
a switch on timings would make the answer depend on the machine's load. The miner does not use this rule: it
measures its own recall per generation (xc/miner/task.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from xc.ann.base import AnnIndex, recall_at_k

# the ANN setting that sets each backend's search breadth (faiss_gpu fixes nprobe when it moves the index to the
# GPU and its flat index is exact: not tuned)
BREADTH_FIELDS = {"diskann": "diskann_search_complexity", "faiss_hnsw": "hnsw_ef_search", "faiss_ivf": "ivf_nprobe"}
BREADTH_STEPS = 6  # doublings at most: 64 -> 4096 for DiskANN's default L_search
PROBE_QUERIES = 256  # queries of the first search call that the breadth is tuned on


def breadth_field(backend: str) -> str | None:
    """The AnnParams field holding `backend`'s search breadth; None where nothing is tuned (exact backends)."""
    return BREADTH_FIELDS.get(backend)


def set_breadth(index: AnnIndex, name: str, value: int) -> None:
    """Search `index` (and every index it wraps: mean-centring, the exact head) at breadth `value` of field `name`;
    every backend reads its breadth from its params at search time."""
    while index is not None:
        index.params = replace(index.params, **{name: int(value)})
        index = getattr(index, "inner", None)


@dataclass
class BreadthTuning:
    """What `tune_breadth` tried: recall@k against exact on `probe` queries at each breadth, in the order tried."""

    name: str
    k: int
    probe: int
    target: float
    tried: dict[int, float] = field(default_factory=dict)  # breadth -> recall in [0, 1]
    chosen: int = 0
    seconds: float = 0.0  # the whole tuning: the probe's exact search and every breadth tried
    query_seconds: dict[int, float] = field(default_factory=dict)  # breadth -> search seconds a probe query
    exact_query_seconds: float = 0.0  # exact search's seconds a probe query (0: not measured)

    @property
    def exact_is_faster(self) -> bool:
        """Whether the probe's exact search took no longer a query than the index at the chosen breadth."""
        return 0 < self.exact_query_seconds <= self.query_seconds.get(self.chosen, 0.0)

    @property
    def reached(self) -> bool:
        return self.tried.get(self.chosen, 0.0) >= self.target

    def summary(self) -> str:
        steps = ", ".join(f"{b}: {100 * r:.1f}%" for b, r in self.tried.items())
        verdict = "reached" if self.reached else "NOT reached at the widest tried"
        speed = f"{1000 * self.query_seconds.get(self.chosen, 0.0):.2f} ms a query"
        if self.exact_query_seconds:
            speed += f" against {1000 * self.exact_query_seconds:.2f} ms for exact search"
        return (f"{self.name}={self.chosen} (recall@{self.k} against exact on {self.probe} queries: {steps}; "
                f"target {100 * self.target:.0f}% {verdict}; {speed}; tuned in {self.seconds:.1f} s)")


def tune_breadth(search_ids: Callable[[int], np.ndarray], exact_ids: np.ndarray, name: str, start: int,
                 target: float) -> BreadthTuning:
    """The narrowest breadth start * 2^j (j <= BREADTH_STEPS) whose recall reaches `target`.

    search_ids(breadth) -> (m, k) ids of the probe queries searched at that breadth; exact_ids (m, k) their exact
    top-k. Recall never falls far with breadth, so the first breadth that reaches the target is taken; where none
    does, the widest tried (the caller warns). The caller sets `seconds` and `exact_query_seconds`."""
    m, k = exact_ids.shape
    out = BreadthTuning(name=name, k=k, probe=m, target=target)
    breadth = max(1, int(start))
    for _ in range(BREADTH_STEPS + 1):
        searched = time.perf_counter()
        ids = search_ids(breadth)
        out.query_seconds[breadth] = (time.perf_counter() - searched) / max(m, 1)
        out.tried[breadth] = recall_at_k(ids, exact_ids)
        out.chosen = breadth
        if out.tried[breadth] >= target:
            break
        breadth *= 2
    return out
