"""The difficulty predictor: for one request, how faithful each cheaper tier's answer would be to `full`'s.

The model is one ridge regression per cheaper tier on standardized [MiniLM embedding | simple features]
(tiers/router_features.py) → fidelity (training/fidelity.py), clipped to [0, 1]; the reference tier is 1.0
by definition. Why ridge: a few hundred labelled prompts are what a first-use build can afford on a CPU,
and with ~400 inputs a linear model with its penalty chosen by cross-validation is what that much data
supports (a deeper model would fit noise); it needs only numpy, trains in milliseconds and predicts in
microseconds once the embedding is made. training/router_training.py builds it.

The artifact is one JSON file (about 20 KB per tier): format and version, the feature spec, per-tier
standardization and weights, how it was trained (prompts, tokens, seed, training-set size, CV error) and
the model version of each tier it was trained against. Loading checks all of it and raises ValueError on
anything broken or incompatible; it loads no model: MiniLM is loaded on the first `predict`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiers.router_features import EMBEDDING, EMBEDDING_DIM, FEATURE_VERSION, SIMPLE_FEATURES, FeatureExtractor

ARTIFACT_FORMAT = "tiergate-difficulty/1"


def default_artifact_path(data_dir: Path) -> Path:
    return Path(data_dir) / "router" / "difficulty.json"


@dataclass
class RidgeHead:
    """fidelity ≈ clip(intercept + coef · (x − mean) / scale, 0, 1)."""

    mean: np.ndarray  # [D]
    scale: np.ndarray  # [D], > 0
    coef: np.ndarray  # [D]
    intercept: float
    alpha: float  # the ridge penalty CV picked
    cv_rmse: float  # k-fold RMSE at that penalty
    baseline_rmse: float  # k-fold RMSE of predicting the training mean: what the features have to beat
    num_train: int
    mean_fidelity: float  # the training set's mean target

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[N, D] → [N] in [0, 1]."""
        return np.clip(self.intercept + ((x - self.mean) / self.scale) @ self.coef, 0.0, 1.0)

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept, "alpha": self.alpha, "cv_rmse": self.cv_rmse,
                "baseline_rmse": self.baseline_rmse, "num_train": self.num_train,
                "mean_fidelity": self.mean_fidelity}

    @classmethod
    def from_json(cls, d: dict[str, Any], dim: int) -> RidgeHead:
        vecs = {k: np.asarray(d[k], dtype=np.float64) for k in ("mean", "scale", "coef")}
        for k, v in vecs.items():
            if v.shape != (dim,) or not np.all(np.isfinite(v)):
                raise ValueError(f"`{k}` must be {dim} finite numbers")
        if np.any(vecs["scale"] <= 0):
            raise ValueError("`scale` must be positive")
        nums = {k: float(d[k]) for k in ("intercept", "alpha", "cv_rmse", "baseline_rmse", "mean_fidelity")}
        if not all(math.isfinite(v) for v in nums.values()):
            raise ValueError("non-finite number in a tier head")
        return cls(vecs["mean"], vecs["scale"], vecs["coef"], nums["intercept"], nums["alpha"], nums["cv_rmse"],
                   nums["baseline_rmse"], int(d["num_train"]), nums["mean_fidelity"])


@dataclass
class DifficultyModel:
    version: str  # "difficulty-v1:<sha of training data + config>"
    reference: str  # the tier every fidelity is measured against (1.0 by definition)
    heads: dict[str, RidgeHead]  # per cheaper tier
    training: dict[str, Any] = field(default_factory=dict)  # prompts, max_tokens, seed, split, …
    tier_versions: dict[str, str] = field(default_factory=dict)  # tier → model version it was trained against
    extractor: FeatureExtractor = field(default_factory=FeatureExtractor, repr=False)

    @property
    def tiers(self) -> list[str]:
        """Tiers it has predictions for: the cheaper tiers and the reference."""
        return [*self.heads, self.reference]

    def predict(self, messages: list[dict]) -> dict[str, float]:
        """Predicted fidelity in [0, 1] per tier name for one conversation (the reference is 1.0)."""
        return self.predict_batch([messages])[0]

    def predict_batch(self, conversations: Sequence[Sequence[dict]]) -> list[dict[str, float]]:
        x = self.extractor.features(conversations)
        columns = {tier: head.predict(x) for tier, head in self.heads.items()}
        return [{**{tier: float(col[i]) for tier, col in columns.items()}, self.reference: 1.0}
                for i in range(len(conversations))]

    # ---- the artifact ----

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ARTIFACT_FORMAT, "version": self.version, "reference": self.reference,
            "features": feature_spec(), "training": self.training, "tier_versions": self.tier_versions,
            "tiers": {tier: head.to_json() for tier, head in self.heads.items()},
        }

    def save(self, path: Path) -> None:
        """Write the artifact atomically (a temporary file renamed over `path`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self.to_json(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the artifact is no secret
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def feature_spec() -> dict[str, Any]:
    return {"version": FEATURE_VERSION, "embedding": EMBEDDING, "embedding_dim": EMBEDDING_DIM,
            "simple": list(SIMPLE_FEATURES)}


def model_from_json(doc: Any, *, extractor: FeatureExtractor | None = None) -> DifficultyModel:
    if not isinstance(doc, dict):
        raise ValueError("the artifact is not a JSON object")
    if doc.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"unknown artifact format {doc.get('format')!r}; expected {ARTIFACT_FORMAT!r}")
    if doc.get("features") != feature_spec():
        raise ValueError("the artifact was trained on other features than this code computes "
                         f"({(doc.get('features') or {}).get('version')!r} vs {FEATURE_VERSION!r}); retrain it "
                         "with `tiergate router train`")
    version, reference, tiers = doc.get("version"), doc.get("reference"), doc.get("tiers")
    if not isinstance(version, str) or not version or not isinstance(reference, str) or not reference:
        raise ValueError("the artifact has no version or reference tier")
    if not isinstance(tiers, dict) or not tiers or reference in tiers:
        raise ValueError("the artifact must hold a head for at least one tier other than the reference")
    dim = EMBEDDING_DIM + len(SIMPLE_FEATURES)
    heads: dict[str, RidgeHead] = {}
    for tier, d in tiers.items():
        try:
            heads[tier] = RidgeHead.from_json(d, dim)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tier {tier!r}: {exc}") from exc
    training, tier_versions = doc.get("training", {}), doc.get("tier_versions", {})
    if not isinstance(training, dict) or not isinstance(tier_versions, dict):
        raise ValueError("`training` and `tier_versions` must be objects")
    return DifficultyModel(version, reference, heads, training, tier_versions, extractor or FeatureExtractor())


def load_difficulty_model(path: Path, *, embedder: Any = None) -> DifficultyModel:
    """Read and check an artifact (fast: no model is loaded). Raises ValueError when it is missing, not
    JSON, or not compatible with this code."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the difficulty model {path}: {exc}") from exc
    try:
        return model_from_json(doc, extractor=FeatureExtractor(embedder))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
