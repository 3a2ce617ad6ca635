"""The difficulty model: features, artifact round-trip and rejection (its fidelity labels and ridge fit are
tested in tests/training/)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tiers.difficulty import (
    CascadeCalibration,
    ConfidenceHead,
    DifficultyModel,
    Lookahead,
    PairThresholds,
    RidgeHead,
    default_artifact_path,
    load_difficulty_model,
)
from tiers.router_features import (
    EMBEDDING_DIM,
    SIMPLE_FEATURES,
    FeatureExtractor,
    has_code,
    question_type,
    script_fractions,
    simple_features,
)


class HashEmbedder:
    """A bag of hashed words, normalized: texts sharing words are similar, unrelated ones near 0."""

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), EMBEDDING_DIM), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                h = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "big")
                out[row, h % EMBEDDING_DIM] += 1.0 if (h >> 32) & 1 else -1.0
            norm = np.linalg.norm(out[row])
            if norm:
                out[row] /= norm
        return out

    def num_tokens(self, text: str) -> int:
        return len(re.findall(r"\w+|[^\w\s]", text)) + 2


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- features ----

def test_code_detection() -> None:
    assert has_code("Why does this fail?\n```python\nprint(x)\n```")
    assert has_code("def f(x):\n    return x + 1\n")
    assert has_code("for (int i = 0; i < n; i++) {\n  total += a[i];\n}")
    assert has_code("SELECT name FROM users WHERE id != 3;\n")
    for prose in ("Let me know what you think about the plan.", "Select the best option and tell me why.",
                  "It costs $100 or $200 depending on the size.", "What is the capital of France?"):
        assert not has_code(prose), prose


def test_script_question_type_and_turns() -> None:
    assert script_fractions("hello") == (0.0, 0.0)
    assert script_fractions("café")[1] == 0.0 and script_fractions("café")[0] == pytest.approx(0.25)
    assert script_fractions("你好世界")[1] == 1.0 and script_fractions("Привет")[1] == 1.0
    assert question_type("How do I sort a list?") == "how"
    assert question_type("  write a poem about rain") == "write"
    assert question_type("Translate this into German") == "translate"
    assert question_type("Hello!") is None
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "why?"}]}]
    f = dict(zip(SIMPLE_FEATURES, simple_features(conv, 3), strict=True))
    assert f["num_user_turns"] == 2 and f["has_system"] == 1 and f["qtype_why"] == 1
    assert f["ends_with_question"] == 1 and f["log_chars_last_user"] == pytest.approx(np.log1p(4))
    assert f["log_chars_conversation"] > f["log_chars_last_user"]


def test_feature_rows_and_length() -> None:
    ext = FeatureExtractor(HashEmbedder())
    x = ext.features([user("short"), user("a much longer question " * 40)])
    assert x.shape == (2, EMBEDDING_DIM + len(SIMPLE_FEATURES)) == (2, ext.dim)
    i = EMBEDDING_DIM + SIMPLE_FEATURES.index("log_tokens_last_user")
    assert x[1, i] > x[0, i]
    assert np.linalg.norm(x[0, :EMBEDDING_DIM]) == pytest.approx(1.0)


# ---- the artifact ----

def make_calibration() -> CascadeCalibration:
    ridge = RidgeHead(np.array([-1.0, 2.0]), np.array([0.5, 1.0]), np.array([0.1, -0.05]), 0.7, 1.0, 0.15, 0.2, 50,
                      0.7, True)
    head = ConfidenceHead(["mean_logprob", "log_tokens"], ridge, np.array([0.2, 0.6, 0.9]), np.array([0.3, 0.7, 0.95]))
    thresholds: list[float | None] = [-math.inf] * 30 + [0.5 + i / 200 for i in range(60)] + [None] * 11
    pairs = {f"small->{t}": PairThresholds("small", t, f, thresholds) for t, f in (("mid", 0.9), ("full", 1.0))}
    early = Lookahead(16, {"small": head}, {"small->mid": pairs["small->mid"]})
    return CascadeCalibration(5, {"small": head}, pairs, {"features": ["mean_logprob", "log_tokens"]}, early)


def make_model(embedder: object = None) -> DifficultyModel:
    dim = EMBEDDING_DIM + len(SIMPLE_FEATURES)
    rng = np.random.default_rng(2)
    heads = {t: RidgeHead(rng.normal(size=dim), rng.uniform(0.5, 2, size=dim), rng.normal(scale=0.01, size=dim),
                          0.7, 10.0, 0.1, 0.12, 50, 0.7, t == "mid") for t in ("small", "mid")}
    return DifficultyModel("difficulty-v1:abc123", "full", heads, {"prompts": 50}, {"full": "v-full"},
                           FeatureExtractor(embedder or HashEmbedder()), make_calibration())


def test_save_load_round_trip_and_predict(tmp_path: Path) -> None:
    model = make_model()
    path = default_artifact_path(tmp_path)
    assert path == tmp_path / "router" / "difficulty.json"
    model.save(path)
    assert not list(path.parent.glob("*.tmp")) and path.stat().st_mode & 0o777 == 0o644  # others may read it
    loaded = load_difficulty_model(path, embedder=HashEmbedder())
    assert loaded.version == "difficulty-v1:abc123" and loaded.tiers == ["small", "mid", "full"]
    assert loaded.training == {"prompts": 50} and loaded.tier_versions == {"full": "v-full"}
    conv = user("How do I reverse a list in Python?")
    got, want = loaded.predict(conv), model.predict(conv)
    assert set(got) == {"small", "mid", "full"} and got["full"] == 1.0
    assert got == pytest.approx(want) and all(0.0 <= v <= 1.0 for v in got.values())
    # whether each head beats the mean, and the cascade's calibration, come back as they were
    assert loaded.uninformative == {"small": "CV RMSE 0.1000 vs 0.1200 predicting the mean"}
    assert loaded.cascade is not None and loaded.cascade.training == {"features": ["mean_logprob", "log_tokens"]}
    head, pair = loaded.cascade.pair("small", "mid")  # type: ignore[misc]
    values = {"mean_logprob": -0.5, "log_tokens": 3.0}
    assert head.score(values) == pytest.approx(model.cascade.heads["small"].score(values))  # type: ignore[union-attr]
    assert head.calibrated(0.4) == pytest.approx(0.5) and head.calibrated(5.0) == 0.95
    assert pair.strong_fidelity == 0.9 and pair.threshold(0.2) == -math.inf and pair.threshold(0.95) is None
    assert pair.threshold(0.3) == pair.threshold(0.295) == 0.5  # a floor between grid points takes the higher
    assert loaded.cascade.pair("mid", "full") is None
    # the look-ahead's heads and thresholds too, for the pairs it has
    assert loaded.cascade.lookahead is not None and loaded.cascade.lookahead.tokens == 16
    early_head, early_pair = loaded.cascade.early_pair("small", "mid")  # type: ignore[misc]
    assert early_head.score(values) == pytest.approx(head.score(values)) and early_pair.threshold(0.3) == 0.5
    assert loaded.cascade.early_pair("small", "full") is None and loaded.cascade.pair("small", "full") is not None


def test_an_artifact_without_a_look_ahead_loads_and_has_none(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    make_model().save(path)
    doc = json.loads(path.read_text())
    del doc["cascade"]["lookahead"]
    path.write_text(json.dumps(doc))
    cascade = load_difficulty_model(path).cascade
    assert cascade is not None and cascade.lookahead is None and cascade.early_pair("small", "mid") is None
    assert cascade.pair("small", "mid") is not None


def test_load_does_not_load_the_embedder(tmp_path: Path) -> None:
    make_model().save(tmp_path / "d.json")
    model = load_difficulty_model(tmp_path / "d.json")
    assert model.extractor._embedder is None  # MiniLM comes on the first predict


@pytest.mark.parametrize("breakage", [
    "not json", "missing", "format", "features", "no_heads", "short_coef", "nan", "reference_head", "list",
    "version_1", "beats_mean", "iso_down", "thresholds_short", "threshold_nan", "pair_without_head", "top_logprobs",
    "lookahead_zero", "lookahead_huge", "lookahead_bool", "lookahead_pair_without_head", "lookahead_not_object",
])
def test_load_rejects_a_broken_artifact(tmp_path: Path, breakage: str) -> None:
    path = tmp_path / "difficulty.json"
    make_model().save(path)
    doc = json.loads(path.read_text())
    if breakage == "not json":
        path.write_text('{"format": "tiergate-difficulty/1", "ver')
    elif breakage == "missing":
        path.unlink()
    else:
        if breakage == "format":
            doc["format"] = "tiergate-difficulty/0"
        elif breakage == "features":
            doc["features"]["simple"] = doc["features"]["simple"][:-1]
        elif breakage == "no_heads":
            doc["tiers"] = {}
        elif breakage == "short_coef":
            doc["tiers"]["small"]["coef"] = doc["tiers"]["small"]["coef"][:10]
        elif breakage == "nan":
            doc["tiers"]["mid"]["intercept"] = float("nan")
        elif breakage == "reference_head":
            doc["tiers"]["full"] = doc["tiers"]["small"]
        elif breakage == "list":
            doc = [doc]
        elif breakage == "version_1":  # an artifact from before `beats_mean` and the cascade: retrained
            doc["format"] = "tiergate-difficulty/1"
        elif breakage == "beats_mean":
            doc["tiers"]["small"]["beats_mean"] = "yes"
        elif breakage == "iso_down":
            doc["cascade"]["tiers"]["small"]["iso_y"] = [0.9, 0.5, 0.95]
        elif breakage == "thresholds_short":
            doc["cascade"]["pairs"]["small->mid"]["thresholds"] = [0.5] * 10
        elif breakage == "threshold_nan":
            doc["cascade"]["pairs"]["small->mid"]["thresholds"][40] = float("nan")
        elif breakage == "pair_without_head":
            doc["cascade"]["pairs"]["mid->full"] = doc["cascade"]["pairs"]["small->mid"] | {"cheap": "mid"}
        elif breakage == "top_logprobs":
            doc["cascade"]["top_logprobs"] = 50
        elif breakage == "lookahead_zero":
            doc["cascade"]["lookahead"]["tokens"] = 0
        elif breakage == "lookahead_huge":
            doc["cascade"]["lookahead"]["tokens"] = 100_000
        elif breakage == "lookahead_bool":
            doc["cascade"]["lookahead"]["tokens"] = True
        elif breakage == "lookahead_pair_without_head":
            doc["cascade"]["lookahead"]["tiers"] = {}
        elif breakage == "lookahead_not_object":
            doc["cascade"]["lookahead"] = [16]
        path.write_text(json.dumps(doc))
    with pytest.raises(ValueError):
        load_difficulty_model(path)
