"""The fidelity score a cheaper tier's answer earns against the reference's: identical answers score 1,
unrelated ones little, and each part is bounded and weighted as documented."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiers.test_difficulty import HashEmbedder
from training.fidelity import EMBED_FLOOR, answer_fidelity, combine, semantic_similarity


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
