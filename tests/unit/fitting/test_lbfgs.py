"""xc/fitting/lbfgs.py: the minimiser reaches the minimum of problems whose minimum is known; its compact-form step
equals the two-loop recursion's."""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize as scipy_minimize

from xc.fitting.lbfgs import CurvaturePairs, direction, minimise


def test_a_quadratic_reaches_its_closed_form_minimum():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((30, 20))
    h = a.T @ a + 0.5 * np.eye(20)  # condition number ~ 100
    b = rng.standard_normal(20)

    def f(v):
        return 0.5 * v @ h @ v - b @ v, h @ v - b

    v = minimise(f, np.zeros(20), iterations=200)
    np.testing.assert_allclose(v, np.linalg.solve(h, b), atol=1e-5)


def test_l2_logistic_regression_matches_scipy_to_the_optimum():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((400, 15))
    y = (x @ rng.standard_normal(15) + 0.5 * rng.standard_normal(400) > 0).astype(np.float64)
    sign, reg = 2 * y - 1, 0.3

    def f(v):
        margin = sign * (x @ v)
        return (np.logaddexp(0, -margin).sum() + 0.5 * reg * v @ v,
                x.T @ (-sign / (1 + np.exp(margin))) + reg * v)

    ours = minimise(f, np.zeros(15), iterations=300)
    reference = scipy_minimize(f, np.zeros(15), jac=True, method="L-BFGS-B", options={"maxiter": 1000, "gtol": 1e-10}).x
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    assert f(ours)[0] <= f(reference)[0] + 1e-8


def test_it_stops_at_a_stationary_start_and_solves_a_non_convex_valley():
    calls = []

    def f(v):
        calls.append(v.copy())
        return float((v ** 2).sum()), 2 * v

    np.testing.assert_array_equal(minimise(f, np.zeros(5), iterations=10), np.zeros(5))
    assert len(calls) == 1  # a zero gradient: no step taken

    def g(v):  # Rosenbrock's valley: the Armijo search must keep it from diverging
        value = float(np.sum((v[1:] - v[:-1] ** 2) ** 2 * 10 + (1 - v[:-1]) ** 2))
        grad = np.zeros_like(v)
        grad[:-1] += -40 * v[:-1] * (v[1:] - v[:-1] ** 2) - 2 * (1 - v[:-1])
        grad[1:] += 20 * (v[1:] - v[:-1] ** 2)
        return value, grad

    v = minimise(g, np.full(6, -1.0), iterations=500)
    np.testing.assert_allclose(v, np.ones(6), atol=1e-3)


def two_loop(g, pairs):
    """-H g by Nocedal and Wright's algorithm 7.4 over (s, y) pairs, oldest first: the reference."""
    q, alphas = -g.copy(), []
    for s, y in reversed(pairs):
        alpha = float(s @ q) / float(s @ y)
        q -= alpha * y
        alphas.append(alpha)
    s, y = pairs[-1]
    q *= float(s @ y) / float(y @ y)
    for (s, y), alpha in zip(pairs, reversed(alphas)):
        q += (alpha - float(y @ q) / float(s @ y)) * s
    return q


def test_the_compact_step_equals_the_two_loop_recursion_before_and_after_the_ring_wraps():
    """The pairs are stored in float32 and the products with them taken in float32: the step equals the float64
    two-loop recursion over the stored (rounded) pairs to float32's precision."""
    rng = np.random.default_rng(2)
    n, history = 50, 4
    a = rng.standard_normal((60, n))
    h = a.T @ a + 0.1 * np.eye(n)  # pairs of a convex quadratic: s.y > 0
    pairs, kept = CurvaturePairs(n, history), []
    for step in range(9):  # 9 pairs through a ring of 4: every slot overwritten, the oldest not at slot 0
        s = rng.standard_normal(n)
        y = h @ s
        pairs.append(s, y)
        kept = (kept + [(s.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64))])[-history:]
        g = rng.standard_normal(n)
        want = two_loop(g, kept)
        np.testing.assert_allclose(direction(g, pairs), want, rtol=2e-4, atol=1e-5 * np.abs(want).max())
    pairs.clear()
    g = rng.standard_normal(n)
    np.testing.assert_allclose(direction(g, pairs), -g / np.linalg.norm(g))  # no pairs: unit steepest descent
    s = rng.standard_normal(n)
    y = h @ s
    pairs.append(s, y)  # after a restart only the new pair counts
    want = two_loop(g, [(s.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64))])
    np.testing.assert_allclose(direction(g, pairs), want, rtol=2e-4, atol=1e-5 * np.abs(want).max())
    assert pairs.s.dtype == pairs.y.dtype == np.float32
