"""Ridge regression in closed form with the penalty chosen by k-fold cross-validation (numpy only): the
difficulty predictor's per-tier heads (step 4 of training/router_training.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiers.difficulty import RidgeHead
from training.router_prompts import RouterTrainingError

DEFAULT_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))


def ridge_fit(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on standardized columns, closed form; returns (mean, scale, coef, intercept).

    Solved in whichever of the primal (D×D) or dual (N×N) forms is smaller; they give the same weights."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-12] = 1.0  # a constant column: left at 0 after centring
    xs = (x - mean) / scale
    intercept = float(y.mean())
    yc = y - intercept
    n, d = xs.shape
    if n >= d:
        coef = np.linalg.solve(xs.T @ xs + alpha * np.eye(d), xs.T @ yc)
    else:
        coef = xs.T @ np.linalg.solve(xs @ xs.T + alpha * np.eye(n), yc)
    return mean, scale, coef, intercept


def _folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


def fit_head(x: np.ndarray, y: np.ndarray, *, alphas: Sequence[float] = DEFAULT_ALPHAS, k: int = 5,
             seed: int = 0) -> RidgeHead:
    """Pick the penalty by k-fold CV (RMSE of clipped predictions), then fit on everything."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        raise RouterTrainingError("at least 2 labelled prompts are needed to fit the difficulty model")
    folds = _folds(n, min(k, n), seed)
    sq_err = np.zeros(len(alphas))
    baseline = 0.0
    for fold in folds:
        train = np.setdiff1d(np.arange(n), fold)
        baseline += float(np.sum((y[fold] - y[train].mean()) ** 2))
        for j, alpha in enumerate(alphas):
            mean, scale, coef, b = ridge_fit(x[train], y[train], alpha)
            pred = np.clip(b + ((x[fold] - mean) / scale) @ coef, 0.0, 1.0)
            sq_err[j] += float(np.sum((y[fold] - pred) ** 2))
    best = int(np.argmin(sq_err))
    mean, scale, coef, b = ridge_fit(x, y, alphas[best])
    return RidgeHead(mean, scale, coef, b, float(alphas[best]), float(np.sqrt(sq_err[best] / n)),
                     float(np.sqrt(baseline / n)), n, float(y.mean()))
