"""The MiniLM embedder: normalized 384-d vectors, batch and single agree, meaning shows in the cosine."""

from __future__ import annotations

import numpy as np

from cache import Embedder


def test_vectors_are_normalized_and_batch_matches_single(embedder: Embedder) -> None:
    texts = ["How do I reverse a list in Python?", "What is the capital of France?"]
    batch = embedder.encode(texts)
    assert batch.shape == (2, 384) and batch.dtype == np.float32
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert np.allclose(embedder.encode_one(texts[0]), batch[0], atol=1e-4)
    assert embedder.encode([]).shape == (0, 384)


def test_paraphrases_are_closer_than_unrelated_questions(embedder: Embedder) -> None:
    a, b, c = embedder.encode(["How do I reverse a list in Python?", "Reversing a Python list: how?",
                               "What is the boiling point of water?"])
    assert float(a @ b) > 0.8 > float(a @ c)


def test_token_counts(embedder: Embedder) -> None:
    assert embedder.max_tokens == 256
    assert embedder.num_tokens("hello world") == 4  # [CLS] hello world [SEP]
