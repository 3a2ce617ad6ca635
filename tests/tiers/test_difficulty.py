"""The difficulty model: fidelity score, features, ridge fit, artifact round-trip and rejection."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tiers.difficulty import DifficultyModel, RidgeHead, default_artifact_path, load_difficulty_model
from tiers.fidelity import EMBED_FLOOR, answer_fidelity, combine, semantic_similarity
from tiers.ridge import fit_head, ridge_fit
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


# ---- fidelity ----

def test_identical_answers_score_one_and_unrelated_ones_lower() -> None:
    emb = HashEmbedder()
    ref = ["Paris is the capital of France, on the Seine.", "Use a dict comprehension: {k: v for k, v in items}."]
    same = answer_fidelity(ref, ref, [1.0, 1.0], emb)
    assert same == pytest.approx([1.0, 1.0])
    unrelated = answer_fidelity(["Bananas are yellow and rich in potassium.", "I like trains very much."], ref,
                                [0.1, 0.1], emb)
    close = answer_fidelity(["Paris is the capital of France.", "Use a dict comprehension: {k: v for k in items}."],
                            ref, [0.8, 0.8], emb)
    assert np.all(unrelated < close) and np.all(close < 1.0) and np.all(unrelated < 0.3)


def test_fidelity_parts_are_bounded_and_weighted() -> None:
    a = np.eye(3)[:2]
    assert semantic_similarity(a, a) == pytest.approx([1.0, 1.0])
    assert semantic_similarity(a, -a) == pytest.approx([0.0, 0.0])  # clipped at 0
    b = np.array([[EMBED_FLOOR, np.sqrt(1 - EMBED_FLOOR ** 2), 0.0]])  # cosine = the floor with a[0]
    assert semantic_similarity(a[:1], b) == pytest.approx([0.0], abs=1e-9)
    assert combine(1.0, 0.0) == pytest.approx(0.5) and combine(0.4, 0.8) == pytest.approx(0.6)
    assert combine(2.0, -1.0) == pytest.approx(0.5)


def test_empty_answers() -> None:
    emb = HashEmbedder()
    assert answer_fidelity(["", "hi there"], ["", ""], [1.0, 0.0], emb) == pytest.approx([1.0, 0.0])
    with pytest.raises(ValueError):
        answer_fidelity(["a"], ["a", "b"], [1.0], emb)


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


# ---- ridge ----

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


# ---- the artifact ----

def make_model(embedder: object = None) -> DifficultyModel:
    dim = EMBEDDING_DIM + len(SIMPLE_FEATURES)
    rng = np.random.default_rng(2)
    heads = {t: RidgeHead(rng.normal(size=dim), rng.uniform(0.5, 2, size=dim), rng.normal(scale=0.01, size=dim),
                          0.7, 10.0, 0.1, 0.12, 50, 0.7) for t in ("small", "mid")}
    return DifficultyModel("difficulty-v1:abc123", "full", heads, {"prompts": 50}, {"full": "v-full"},
                           FeatureExtractor(embedder or HashEmbedder()))


def test_save_load_round_trip_and_predict(tmp_path: Path) -> None:
    model = make_model()
    path = default_artifact_path(tmp_path)
    assert path == tmp_path / "router" / "difficulty.json"
    model.save(path)
    assert not list(path.parent.glob("*.tmp"))
    loaded = load_difficulty_model(path, embedder=HashEmbedder())
    assert loaded.version == "difficulty-v1:abc123" and loaded.tiers == ["small", "mid", "full"]
    assert loaded.training == {"prompts": 50} and loaded.tier_versions == {"full": "v-full"}
    conv = user("How do I reverse a list in Python?")
    got, want = loaded.predict(conv), model.predict(conv)
    assert set(got) == {"small", "mid", "full"} and got["full"] == 1.0
    assert got == pytest.approx(want) and all(0.0 <= v <= 1.0 for v in got.values())


def test_load_does_not_load_the_embedder(tmp_path: Path) -> None:
    make_model().save(tmp_path / "d.json")
    model = load_difficulty_model(tmp_path / "d.json")
    assert model.extractor._embedder is None  # MiniLM comes on the first predict


@pytest.mark.parametrize("breakage", [
    "not json", "missing", "format", "features", "no_heads", "short_coef", "nan", "reference_head", "list",
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
        path.write_text(json.dumps(doc))
    with pytest.raises(ValueError):
        load_difficulty_model(path)
