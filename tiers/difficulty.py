"""The difficulty predictor: for one request, how faithful each cheaper tier's answer would be to `full`'s.

The model is one ridge regression per cheaper tier on standardized [MiniLM embedding | simple features]
(tiers/router_features.py) → fidelity (training/fidelity.py), clipped to [0, 1]; the reference tier is 1.0
by definition. Why ridge: a few hundred labelled prompts are what a first-use build can afford on a CPU,
and with ~400 inputs a linear model with its penalty chosen by cross-validation is what that much data
supports (a deeper model would fit noise); it needs only numpy, trains in milliseconds and predicts in
microseconds once the embedding is made. training/router_training.py builds it.

A head must earn its place: `beats_mean` says whether its cross-validated error is below that of predicting
the training mean by more than noise (training/ridge.py's test). Where it is not, the model cannot tell that
tier's easy prompts from its hard ones, and `auto` says so and falls back to the cascade (tiers/routing.py).

The cascade's calibration travels in the same artifact (`CascadeCalibration`): per cheaper tier, a confidence
head from the engine's signals on its own answer (tiers/cascade.py's SIGNAL_FEATURES) to that answer's
fidelity, mapped through an isotonic fit on out-of-fold predictions so that its output is a calibrated
expected fidelity; and per tier pair (cheap → the dearer tier a cascade retries on), the score threshold an
answer must clear for each quality floor on a grid of 0.01 (training/confidence.py says how they are chosen).
Optionally the same again read on an answer's first `lookahead.tokens` tokens (`Lookahead`): the gateway then
judges the cheap answer as soon as it has that many tokens and, when it falls short, stops it there and retries
(bench/router.py measured that deciding early pays: the retried answers' cheap attempts cost less).
Optionally, per tier pair, a stop at a divergence risk (`stops`, tiers/divergence.py's `DivergenceStop`): the
gateway then sums the risk token by token as a non-streamed cheap answer is made and stops it where the sum passes
the pair's threshold (`tiergate router train` fits it on the training answers, as bench/router.py does,
training/divergence_fit.py; an artifact without it loads and runs as before). Adding a stop changes the artifact's
`version` (`with_stops`): answers the cascade accepted are kept in the cache under the version whose check accepted
them.

The artifact is one JSON file (about 20 KB per tier): format and version, the feature spec, per-tier
standardization and weights, how it was trained (prompts, tokens, seed, training-set size, CV error) and
the model version of each tier it was trained against. Loading checks all of it and raises ValueError on
anything broken or incompatible; it loads no model: MiniLM is loaded on the first `predict`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from assets.atomic_file import replacing
from tiers.divergence import DivergenceStop
from tiers.router_features import EMBEDDING, EMBEDDING_DIM, FEATURE_VERSION, SIMPLE_FEATURES, FeatureExtractor

ARTIFACT_FORMAT = "tiergate-difficulty/2"  # /2: `beats_mean` per head and the cascade's calibration
FLOOR_GRID = tuple(round(i / 100, 2) for i in range(101))  # the floors a pair has thresholds for


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
    beats_mean: bool = False  # CV error below the mean's by more than noise: the head tells prompts apart

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[N, D] → [N] in [0, 1]."""
        return np.clip(self.intercept + ((x - self.mean) / self.scale) @ self.coef, 0.0, 1.0)

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept, "alpha": self.alpha, "cv_rmse": self.cv_rmse,
                "baseline_rmse": self.baseline_rmse, "num_train": self.num_train,
                "mean_fidelity": self.mean_fidelity, "beats_mean": self.beats_mean}

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
        if not isinstance(d["beats_mean"], bool):
            raise ValueError("`beats_mean` must be true or false")
        return cls(vecs["mean"], vecs["scale"], vecs["coef"], nums["intercept"], nums["alpha"], nums["cv_rmse"],
                   nums["baseline_rmse"], int(d["num_train"]), nums["mean_fidelity"], d["beats_mean"])

    def no_better_than_mean(self) -> str:
        """Why the head is not used, for the route reason."""
        return f"CV RMSE {self.cv_rmse:.4f} vs {self.baseline_rmse:.4f} predicting the mean"


@dataclass
class ConfidenceHead:
    """A cheaper tier's confidence in its own answer: ridge on the named signals, then an isotonic map to
    expected fidelity (piecewise linear through (iso_x, iso_y), flat outside)."""

    features: list[str]  # names from tiers/cascade.py's SIGNAL_FEATURES, in column order
    ridge: RidgeHead  # signals → raw score (fidelity units, before calibration)
    iso_x: np.ndarray  # [K] increasing raw scores
    iso_y: np.ndarray  # [K] non-decreasing expected fidelity

    def score(self, values: dict[str, float]) -> float | None:
        """The raw score of one answer's signals, or None when one it needs is missing."""
        if any(name not in values for name in self.features):
            return None
        x = np.asarray([values[name] for name in self.features], dtype=np.float64)  # [F]
        return float(self.ridge.intercept + ((x - self.ridge.mean) / self.ridge.scale) @ self.ridge.coef)

    def calibrated(self, score: float) -> float:
        """Expected fidelity of an answer with this raw score."""
        return float(np.interp(score, self.iso_x, self.iso_y))

    def to_json(self) -> dict[str, Any]:
        return {"features": self.features, "ridge": self.ridge.to_json(), "iso_x": self.iso_x.tolist(),
                "iso_y": self.iso_y.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ConfidenceHead:
        features = d["features"]
        if not isinstance(features, list) or not features or not all(isinstance(f, str) for f in features):
            raise ValueError("`features` must be a non-empty list of names")
        iso_x, iso_y = (np.asarray(d[k], dtype=np.float64) for k in ("iso_x", "iso_y"))
        if (iso_x.ndim != 1 or iso_x.shape != iso_y.shape or len(iso_x) == 0 or not np.all(np.isfinite(iso_x))
                or not np.all(np.isfinite(iso_y)) or np.any(np.diff(iso_x) < 0) or np.any(np.diff(iso_y) < 0)):
            raise ValueError("`iso_x` and `iso_y` must be equally long, finite and non-decreasing")
        return cls(list(features), RidgeHead.from_json(d["ridge"], len(features)), iso_x, iso_y)


@dataclass
class PairThresholds:
    """When a `cheap` answer stands rather than being retried on `strong`: its raw confidence score must reach
    `thresholds[i]` for a plan floor of FLOOR_GRID[i] (None: no score does, always retry; −∞, written
    -Infinity: every answer does)."""

    cheap: str
    strong: str
    strong_fidelity: float  # the dearer tier's mean fidelity: retrying cannot promise more than this
    thresholds: list[float | None]  # one per FLOOR_GRID entry, non-decreasing (None above every number)

    def threshold(self, floor: float) -> float | None:
        """The threshold for a plan's floor, rounded up to the grid (never a lower bar than asked)."""
        i = min(max(math.ceil(round(floor * 100, 6)), 0), len(FLOOR_GRID) - 1)
        return self.thresholds[i]

    def to_json(self) -> dict[str, Any]:
        return {"cheap": self.cheap, "strong": self.strong, "strong_fidelity": self.strong_fidelity,
                "thresholds": self.thresholds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PairThresholds:
        thresholds = d["thresholds"]
        if not isinstance(thresholds, list) or len(thresholds) != len(FLOOR_GRID):
            raise ValueError(f"`thresholds` must have {len(FLOOR_GRID)} entries (floors 0.00 to 1.00)")
        out: list[float | None] = [None if t is None else float(t) for t in thresholds]
        if not all(t is None or math.isfinite(t) or t == -math.inf for t in out):
            raise ValueError("`thresholds` must be numbers, -Infinity or null")
        strong_fidelity = float(d["strong_fidelity"])
        if not math.isfinite(strong_fidelity):
            raise ValueError("`strong_fidelity` must be finite")
        return cls(str(d["cheap"]), str(d["strong"]), strong_fidelity, out)


MAX_LOOKAHEAD = 256  # tokens: a look-ahead longer than this is not a look-ahead


@dataclass
class Lookahead:
    """Confidence heads and thresholds read on an answer's first `tokens` tokens (or the whole answer, when it
    is shorter): an answer is judged as soon as it has one token more than that."""

    tokens: int
    heads: dict[str, ConfidenceHead]
    pairs: dict[str, PairThresholds]  # "cheap->strong"


@dataclass
class CascadeCalibration:
    """The cascade's confidence heads (per cheaper tier) and thresholds (per tier pair), on whole answers and,
    where trained, on their first tokens (`lookahead`)."""

    top_logprobs: int  # alternatives per token the signals were measured with (ask the tier for as many)
    heads: dict[str, ConfidenceHead]
    pairs: dict[str, PairThresholds]  # "cheap->strong"
    training: dict[str, Any] = field(default_factory=dict)  # prompts, CV errors, what each signal set scored
    lookahead: Lookahead | None = None
    stops: dict[str, DivergenceStop] = field(default_factory=dict)  # "cheap->strong": its stop at a divergence risk

    def stop(self, cheap: str, strong: str) -> DivergenceStop | None:
        """The pair's stop at a divergence risk, when the artifact has one."""
        return self.stops.get(f"{cheap}->{strong}")

    def pair(self, cheap: str, strong: str) -> tuple[ConfidenceHead, PairThresholds] | None:
        head, pair = self.heads.get(cheap), self.pairs.get(f"{cheap}->{strong}")
        return None if head is None or pair is None else (head, pair)

    def early_pair(self, cheap: str, strong: str) -> tuple[ConfidenceHead, PairThresholds] | None:
        """The look-ahead's head and thresholds for the pair, when the artifact has them."""
        if self.lookahead is None:
            return None
        head, pair = self.lookahead.heads.get(cheap), self.lookahead.pairs.get(f"{cheap}->{strong}")
        return None if head is None or pair is None else (head, pair)

    def to_json(self) -> dict[str, Any]:
        out = {"top_logprobs": self.top_logprobs, "tiers": {t: h.to_json() for t, h in self.heads.items()},
               "pairs": {k: p.to_json() for k, p in self.pairs.items()}, "training": self.training}
        if self.lookahead is not None:
            out["lookahead"] = {"tokens": self.lookahead.tokens,
                                "tiers": {t: h.to_json() for t, h in self.lookahead.heads.items()},
                                "pairs": {k: p.to_json() for k, p in self.lookahead.pairs.items()}}
        if self.stops:
            out["stops"] = {k: stop.to_json() for k, stop in self.stops.items()}
        return out

    @classmethod
    def from_json(cls, d: Any) -> CascadeCalibration:
        if not isinstance(d, dict):
            raise ValueError("`cascade` must be an object with `tiers` and `pairs`")
        heads, pairs = _heads_and_pairs(d, "cascade")
        top = d.get("top_logprobs")
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            raise ValueError("`top_logprobs` must be an integer within 0..20")
        training = d.get("training", {})
        lookahead = None
        if (early := d.get("lookahead")) is not None:
            tokens = early.get("tokens") if isinstance(early, dict) else None
            if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= MAX_LOOKAHEAD:
                raise ValueError(f"`lookahead.tokens` must be an integer within 1..{MAX_LOOKAHEAD}")
            lookahead = Lookahead(tokens, *_heads_and_pairs(early, "cascade look-ahead"))
        return cls(top, heads, pairs, training if isinstance(training, dict) else {}, lookahead,
                   _stops(d.get("stops"), top))


def _stops(d: Any, top_logprobs: int) -> dict[str, DivergenceStop]:
    """The `stops` section (absent: none), every entry checked: a bad one refuses the artifact, as a bad head
    does; the margins it reads need two alternatives per token (`top_logprobs` at least 2)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError("`cascade.stops` must be an object of \"cheap->strong\": stop")
    if d and top_logprobs < 2:
        raise ValueError("`cascade.stops` reads top-2 margins: `top_logprobs` must be at least 2")
    stops = {}
    for key, entry in d.items():
        try:
            stops[key] = DivergenceStop.from_json(entry)
        except ValueError as exc:
            raise ValueError(f"cascade stop {key!r}: {exc}") from exc
        if key != f"{stops[key].cheap}->{stops[key].strong}":
            raise ValueError(f"cascade stop {key!r} names another pair ({stops[key].cheap}->{stops[key].strong})")
    return stops


def _heads_and_pairs(d: dict[str, Any], what: str) -> tuple[dict[str, ConfidenceHead], dict[str, PairThresholds]]:
    if not isinstance(d.get("tiers"), dict) or not isinstance(d.get("pairs"), dict):
        raise ValueError(f"`{what}` must be an object with `tiers` and `pairs`")
    heads, pairs = {}, {}
    for tier, h in d["tiers"].items():
        try:
            heads[tier] = ConfidenceHead.from_json(h)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{what} tier {tier!r}: {exc}") from exc
    for key, p in d["pairs"].items():
        try:
            pairs[key] = PairThresholds.from_json(p)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{what} pair {key!r}: {exc}") from exc
        if key != f"{pairs[key].cheap}->{pairs[key].strong}" or pairs[key].cheap not in heads:
            raise ValueError(f"{what} pair {key!r} names no confidence head or another pair")
    return heads, pairs


@dataclass
class DifficultyModel:
    version: str  # "difficulty-v1:<sha of training data + config>"
    reference: str  # the tier every fidelity is measured against (1.0 by definition)
    heads: dict[str, RidgeHead]  # per cheaper tier
    training: dict[str, Any] = field(default_factory=dict)  # prompts, max_tokens, seed, split, …
    tier_versions: dict[str, str] = field(default_factory=dict)  # tier → model version it was trained against
    extractor: FeatureExtractor = field(default_factory=FeatureExtractor, repr=False)
    cascade: CascadeCalibration | None = None  # the cascade's confidence heads and thresholds

    @property
    def tiers(self) -> list[str]:
        """Tiers it has predictions for: the cheaper tiers and the reference."""
        return [*self.heads, self.reference]

    @property
    def uninformative(self) -> dict[str, str]:
        """Tiers whose head does not beat predicting the mean, and its numbers (for the route reason)."""
        return {tier: head.no_better_than_mean() for tier, head in self.heads.items() if not head.beats_mean}

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
            "cascade": self.cascade.to_json() if self.cascade is not None else None,
        }

    def with_stops(self, stops: dict[str, DivergenceStop]) -> DifficultyModel:
        """This model with the cascade's stops replaced by `stops`, under a version of its own (the base version and
        a hash of the stops: the cache keeps an accepted answer under the version whose check accepted it)."""
        if self.cascade is None:
            raise ValueError("a stop needs the cascade's calibration (top_logprobs) in the artifact")
        cascade = replace(self.cascade, stops=dict(stops))
        _stops({k: s.to_json() for k, s in stops.items()}, cascade.top_logprobs)  # the checks a load would make
        base = self.version.split("+stop:")[0]
        digest = hashlib.sha256(json.dumps(cascade.to_json().get("stops", {}), sort_keys=True).encode()).hexdigest()
        return replace(self, version=f"{base}+stop:{digest[:12]}" if stops else base, cascade=cascade)

    def save(self, path: Path) -> None:
        """Write the artifact atomically (a temporary file renamed over `path`), on disk before it is in place."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path, mode=0o644, sync=True) as tmp:  # the artifact is no secret
            tmp.write_text(json.dumps(self.to_json()), encoding="utf-8")


def feature_spec() -> dict[str, Any]:
    return {"version": FEATURE_VERSION, "embedding": EMBEDDING, "embedding_dim": EMBEDDING_DIM,
            "simple": list(SIMPLE_FEATURES)}


def model_from_json(doc: Any, *, extractor: FeatureExtractor | None = None) -> DifficultyModel:
    if not isinstance(doc, dict):
        raise ValueError("the artifact is not a JSON object")
    if doc.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"unknown artifact format {doc.get('format')!r}; expected {ARTIFACT_FORMAT!r} (retrain it "
                         "with `tiergate router train`)")
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
    cascade = None if doc.get("cascade") is None else CascadeCalibration.from_json(doc["cascade"])
    return DifficultyModel(version, reference, heads, training, tier_versions, extractor or FeatureExtractor(),
                           cascade)


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
