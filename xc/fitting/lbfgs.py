"""Unconstrained L-BFGS for the lexical ranker's solves (`xc/fitting/ranker.py`).

    minimise f(v) over v in R^n, given f and its gradient; n is a block of labels' weights, ~10^6-10^7

Why not scipy's L-BFGS-B: it handles bounds the ranker has none of, and on debian-deps' 2M-variable blocks its
bound bookkeeping took about 60% of the solve (py-spy), more than the loss and gradient themselves. The step is
L-BFGS's -H g with a backtracking Armijo line search: in the ranker's Jacobi-scaled variables the unit step is
accepted at almost every iteration, so a step costs one function evaluation and the product H g.

H g is computed in the compact representation (Byrd, Nocedal and Schnabel, "Representations of quasi-Newton
matrices and their use in limited memory methods", 1994; Nocedal and Wright, Numerical Optimization, eq. 7.24),
which equals the two-loop recursion (algorithm 7.4) in exact arithmetic: the m stored pairs are rows of two
(m, n) arrays, so H g is four matrix-vector products over them plus an m x m solve, and a new pair adds one
pass over each. The two-loop recursion makes 4 m vector operations of length n with temporaries (about 14 m vector
reads and writes); here about 6 m, in BLAS (debian-deps' ranker fit 40.3 s -> 37.5 s on 2 threads, same weights).
The pairs are kept in float32 and multiplied in float32: those reads were still most of a solve, and halving
them took debian-deps' ranker from 46 to 38 s on 2 threads, its choice and test figures the same to the digit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.linalg import solve_triangular

ARMIJO = 1e-4  # sufficient decrease: f(v + t d) <= f(v) + ARMIJO t g.d
MAX_HALVINGS = 30


class CurvaturePairs:
    """The last `history` curvature pairs (s_i = v_{i+1} - v_i, y_i = g_{i+1} - g_i) as rows of S and Y (ring
    buffers of shape (history, n)), with the small products the compact form needs: S Y^T and Y Y^T (m, m)."""

    def __init__(self, n: int, history: int):
        self.history, self.count, self.next = history, 0, 0
        # float32 rows: the pairs are read three times a step (H g's two products, a new pair's), and at the ranker's
        # 10^5-10^7 variables that reading, not the loss, was most of its solve; H g is a search direction, which the
        # line search and the float64 iterate make as good in float32
        self.s = np.zeros((history, n), np.float32)
        self.y = np.zeros((history, n), np.float32)
        self.sy = np.zeros((history, history))  # sy[i, j] = s_i . y_j (slots, not ages)
        self.yy = np.zeros((history, history))

    def __bool__(self) -> bool:
        return self.count > 0

    def clear(self) -> None:
        self.count = self.next = 0

    def append(self, s: np.ndarray, y: np.ndarray) -> None:
        slot = self.next
        self.s[slot], self.y[slot] = s, y
        # slots fill 0, 1, ... and are then overwritten oldest first, so the filled ones are always 0..count-1;
        # slices, not index arrays: an index array would copy the (count, n) rows
        count = min(self.count + 1, self.history)
        stored_s, stored_y = self.s[:count], self.y[:count]
        new_s, new_y = self.s[slot], self.y[slot]
        self.sy[:count, slot] = stored_s @ new_y  # s_i . y_new
        # two products with Y rather than one with the (n, 2) stack of s_new and y_new: the stack's copy and its
        # strided product took longer than a second pass over Y (n = 2M, 10 pairs: 16-19 against 27-51 ms)
        self.sy[slot, :count] = stored_y @ new_s
        self.yy[:count, slot] = self.yy[slot, :count] = stored_y @ new_y
        self.next = (slot + 1) % self.history
        self.count = count

    def oldest_first(self) -> np.ndarray:
        """Slot indices from the oldest pair to the newest."""
        if self.count < self.history:
            return np.arange(self.count)
        return (self.next + np.arange(self.history)) % self.history

    def newest(self) -> int:
        return (self.next - 1) % self.history


def minimise(loss_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]], v0: np.ndarray, iterations: int,
             history: int = 10, gtol: float = 1e-6) -> np.ndarray:
    """The point after `iterations` accepted steps from v0 (n,) float64 (fewer where the gradient's largest entry
    falls under gtol or no step decreases f); loss_and_grad(v) -> (f, grad (n,))."""
    v = np.array(v0, dtype=np.float64)
    f, g = loss_and_grad(v)
    pairs = CurvaturePairs(len(v), history)
    for _ in range(iterations):
        if np.abs(g).max() <= gtol:
            break
        d = direction(g, pairs)
        slope = float(g @ d)
        if slope >= 0.0:  # not a descent direction (curvature pairs gone stale): restart from steepest descent
            pairs.clear()
            d = direction(g, pairs)
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
            pairs.append(s, y)
        v, f, g = trial, f_new, g_new
    return v


def direction(g: np.ndarray, pairs: CurvaturePairs) -> np.ndarray:
    """-H g (n,) with H the L-BFGS inverse Hessian of the stored pairs in compact form, H0 = gamma I with gamma =
    s.y / y.y of the newest pair (the two-loop recursion's scaling); without pairs, steepest descent of unit
    length.

        H = gamma I + [S' gamma Y'] [[R^-T (D + gamma Y Y^T) R^-1, -R^-T], [-R^-1, 0]] [S; gamma Y]

    with S, Y (m, n) oldest first, R the upper triangle of S Y^T (R_ij = s_i . y_j, i <= j), D its diagonal."""
    if not pairs:
        return -g / max(1.0, float(np.linalg.norm(g)))
    order = pairs.oldest_first()
    newest = pairs.newest()
    gamma = pairs.sy[newest, newest] / pairs.yy[newest, newest]
    stored_s, stored_y = pairs.s[:pairs.count], pairs.y[:pairs.count]  # slots 0..count-1, in storage order
    g32 = g.astype(np.float32)
    sg, yg = (stored_s @ g32).astype(np.float64)[order], (stored_y @ g32).astype(np.float64)[order]  # S g, Y g by age
    r = np.triu(pairs.sy[np.ix_(order, order)])
    yy = pairs.yy[np.ix_(order, order)]
    d = np.diag(r)
    rinv_sg = solve_triangular(r, sg, lower=False)  # R^-1 S g
    b = -rinv_sg
    inner = d * rinv_sg + gamma * (yy @ rinv_sg) - gamma * yg  # (D + gamma Y Y^T) R^-1 S g - gamma Y g
    a = solve_triangular(r, inner, lower=False, trans="T")  # R^-T (...)
    # back to slot order for the products with the stored rows
    a_slot, b_slot = np.empty_like(a), np.empty_like(b)
    a_slot[order], b_slot[order] = a, b
    hg = gamma * g + stored_s.T @ a_slot.astype(np.float32) + stored_y.T @ (gamma * b_slot).astype(np.float32)
    return -hg
