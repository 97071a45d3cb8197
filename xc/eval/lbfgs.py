"""Unconstrained L-BFGS for the lexical ranker's solves (`xc/eval/ranker.py`).

    minimise f(v) over v in R^n, given f and its gradient; n is a block of labels' weights, ~10^6-10^7

Why not scipy's L-BFGS-B: it handles bounds the ranker has none of, and on debian-deps' 2M-variable blocks its
bound bookkeeping took about 60% of the solve (py-spy), more than the loss and gradient themselves. This is the
textbook two-loop recursion (Nocedal and Wright, Numerical Optimization, algorithm 7.4) with a backtracking Armijo
line search: in the ranker's Jacobi-scaled variables the unit step is accepted at almost every iteration, so a
step costs one function evaluation and ~4 m vector operations of length n.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

ARMIJO = 1e-4  # sufficient decrease: f(v + t d) <= f(v) + ARMIJO t g.d
MAX_HALVINGS = 30


def minimise(loss_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]], v0: np.ndarray, iterations: int,
             history: int = 10, gtol: float = 1e-6) -> np.ndarray:
    """The point after `iterations` accepted steps from v0 (n,) float64 (fewer where the gradient's largest entry
    falls under gtol or no step decreases f); loss_and_grad(v) -> (f, grad (n,))."""
    v = np.array(v0, dtype=np.float64)
    f, g = loss_and_grad(v)
    pairs: deque = deque(maxlen=history)  # (s, y, 1 / s.y) of the last `history` steps
    for _ in range(iterations):
        if np.abs(g).max() <= gtol:
            break
        d = _direction(g, pairs)
        slope = float(g @ d)
        if slope >= 0.0:  # not a descent direction (curvature pairs gone stale): restart from steepest descent
            pairs.clear()
            d = _direction(g, pairs)
            slope = float(g @ d)
        step = 1.0
        for _ in range(MAX_HALVINGS):
            trial = v + step * d
            f_new, g_new = loss_and_grad(trial)
            if f_new <= f + ARMIJO * step * slope:
                break
            step *= 0.5
        else:
            break  # no decrease along d: v is as good as this method gets
        s, y = trial - v, g_new - g
        sy = float(s @ y)
        if sy > 1e-12 * float(y @ y):  # keep only pairs that carry positive curvature
            pairs.append((s, y, 1.0 / sy))
        v, f, g = trial, f_new, g_new
    return v


def _direction(g: np.ndarray, pairs: deque) -> np.ndarray:
    """-H g by the two-loop recursion over the stored pairs; without pairs, steepest descent of unit length."""
    if not pairs:
        return -g / max(1.0, float(np.linalg.norm(g)))
    q = -g.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        alpha = rho * float(s @ q)
        q -= alpha * y
        alphas.append(alpha)
    s, y, _ = pairs[-1]
    q *= float(s @ y) / float(y @ y)  # the initial inverse Hessian: the last step's curvature along y
    for (s, y, rho), alpha in zip(pairs, reversed(alphas)):
        beta = rho * float(y @ q)
        q += (alpha - beta) * s
    return q
