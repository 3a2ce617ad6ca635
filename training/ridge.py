"""Ridge regression in closed form with the penalty chosen by k-fold cross-validation (numpy only): the
difficulty predictor's per-tier heads (step 4 of training/router_training.py) and the cascade's confidence
heads (training/confidence.py).

Whether a head beats predicting the mean is a paired test on the same out-of-fold predictions: per prompt,
the squared error of the fold's training mean minus the head's; the head beats the mean when the average
difference exceeds `BEATS_MEAN_Z` standard errors. A head whose penalty went to the top of the grid predicts
nearly the mean and fails it, as does one whose small gain is within what 5 folds of a few hundred prompts
show by chance."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiers.difficulty import RidgeHead
from training.router_prompts import RouterTrainingError

DEFAULT_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))
BEATS_MEAN_Z = 2.0  # standard errors of the paired squared-error difference (one-sided, about 98%)


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


def cross_validate(x: np.ndarray, y: np.ndarray, *, alphas: Sequence[float] = DEFAULT_ALPHAS, k: int = 5,
                   seed: int = 0) -> tuple[float, np.ndarray, np.ndarray]:
    """The penalty with the least k-fold RMSE (of clipped predictions), the out-of-fold predictions at that
    penalty, and the out-of-fold predictions of the fold's training mean; all [N]."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        raise RouterTrainingError("at least 2 labelled prompts are needed to fit the difficulty model")
    oof = np.zeros((len(alphas), n))
    base = np.zeros(n)
    for fold in _folds(n, min(k, n), seed):
        train = np.setdiff1d(np.arange(n), fold)
        base[fold] = y[train].mean()
        for j, alpha in enumerate(alphas):
            mean, scale, coef, b = ridge_fit(x[train], y[train], alpha)
            oof[j, fold] = np.clip(b + ((x[fold] - mean) / scale) @ coef, 0.0, 1.0)
    best = int(np.argmin(np.sum((oof - y) ** 2, axis=1)))
    return float(alphas[best]), oof[best], base


def beats_mean(y: np.ndarray, predicted: np.ndarray, baseline: np.ndarray, *, z: float = BEATS_MEAN_Z) -> bool:
    """Whether `predicted` has less squared error than `baseline` on `y` by more than `z` standard errors."""
    gain = (np.asarray(y) - np.asarray(baseline)) ** 2 - (np.asarray(y) - np.asarray(predicted)) ** 2
    if len(gain) < 2:
        return False
    se = float(gain.std(ddof=1)) / np.sqrt(len(gain))
    return bool(gain.mean() > z * se and gain.mean() > 0)


def fit_head(x: np.ndarray, y: np.ndarray, *, alphas: Sequence[float] = DEFAULT_ALPHAS, k: int = 5,
             seed: int = 0) -> RidgeHead:
    """Pick the penalty by k-fold CV (RMSE of clipped predictions), then fit on everything."""
    return fit_head_oof(x, y, alphas=alphas, k=k, seed=seed)[0]


def fit_head_oof(x: np.ndarray, y: np.ndarray, *, alphas: Sequence[float] = DEFAULT_ALPHAS, k: int = 5,
                 seed: int = 0) -> tuple[RidgeHead, np.ndarray]:
    """`fit_head`, and its out-of-fold predictions (what calibration needs: scores the head made blind)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    alpha, oof, base = cross_validate(x, y, alphas=alphas, k=k, seed=seed)
    mean, scale, coef, b = ridge_fit(x, y, alpha)
    rmse = float(np.sqrt(np.mean((y - oof) ** 2)))
    base_rmse = float(np.sqrt(np.mean((y - base) ** 2)))
    return RidgeHead(mean, scale, coef, b, alpha, rmse, base_rmse, len(y), float(y.mean()),
                     beats_mean(y, oof, base)), oof
