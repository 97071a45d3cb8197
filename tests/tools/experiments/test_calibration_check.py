"""tools/experiments/calibration_check.py: the agreement figures against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from tools.experiments.calibration_check import agreement


def test_agreement_is_the_brier_score_and_the_binned_calibration_error():
    probs = np.array([0.05, 0.05, 0.95, 0.95, 0.55])
    hits = np.array([False, True, True, True, False])
    out = agreement(probs, hits)
    # Brier: (0.05^2 + 0.95^2 + 0.05^2 + 0.05^2 + 0.55^2) / 5
    assert out["brier"] == pytest.approx((0.0025 + 0.9025 + 0.0025 + 0.0025 + 0.3025) / 5, abs=1e-5)
    # bins: [0.05, 0.05] hit 1/2 -> |0.05 - 0.5| x 2; [0.95, 0.95] hit 1 -> 0.05 x 2; [0.55] hit 0 -> 0.55 x 1
    assert out["ece"] == pytest.approx((0.45 * 2 + 0.05 * 2 + 0.55) / 5, abs=1e-4)
    assert out["mean_p"] == pytest.approx(0.51) and out["hit_rate"] == pytest.approx(0.6)
