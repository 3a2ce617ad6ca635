"""The difficulty model's ridge fit: it recovers a planted relation, cross-validation picks a small penalty
for signal and a large one for noise, and only a real gain counts as beating the mean."""

from __future__ import annotations

import numpy as np
import pytest

from training.ridge import fit_head, ridge_fit


def test_ridge_recovers_a_planted_linear_relation() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 10)) * rng.uniform(0.5, 3, size=10) + rng.normal(size=10)
    w = rng.normal(size=10)
    y = 0.3 + x @ w + rng.normal(scale=0.01, size=400)
    mean, scale, coef, b = ridge_fit(x, y, alpha=1e-6)
    assert coef / scale == pytest.approx(w, abs=0.01)
    assert b - (mean / scale) @ coef == pytest.approx(0.3, abs=0.02)
    # the dual form (fewer rows than columns) gives the primal's weights
    xs, ys = x[:8], y[:8]
    _, _, dual, _ = ridge_fit(xs, ys, alpha=0.5)
    m, s = xs.mean(0), xs.std(0)
    z = (xs - m) / s
    assert dual == pytest.approx(np.linalg.solve(z.T @ z + 0.5 * np.eye(10), z.T @ (ys - ys.mean())))


def test_cv_picks_a_small_penalty_for_signal_and_a_large_one_for_noise() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 20))
    signal = fit_head(x, np.clip(0.5 + 0.1 * x[:, 0] - 0.05 * x[:, 1], 0, 1))
    noise = fit_head(x, rng.uniform(0, 1, size=200))
    assert signal.cv_rmse < 0.3 * signal.baseline_rmse and signal.alpha < noise.alpha
    assert noise.cv_rmse >= 0.95 * noise.baseline_rmse  # nothing to learn: no better than the mean
    assert signal.beats_mean and not noise.beats_mean


def test_a_gain_within_noise_does_not_beat_the_mean() -> None:
    """A weak feature whose CV error is a hair below the mean's (as the first difficulty model's 0.1247 vs
    0.1248) is not reported as beating it."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(160, 50))
    y = np.clip(0.6 + 0.002 * x[:, 0] + rng.normal(scale=0.12, size=160), 0, 1)
    head = fit_head(x, y)
    assert head.cv_rmse == pytest.approx(head.baseline_rmse, rel=0.05) and not head.beats_mean
