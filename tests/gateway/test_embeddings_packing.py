"""How an embeddings answer is kept under its Idempotency-Key: its vectors as base85 of their float32, what
`base64.b85encode` writes, read back bit for bit (NaN, -0.0 and infinities too), 1,920 characters a vector."""

from __future__ import annotations

import base64

import numpy as np

from gateway.embedding_bodies import pack_vectors, unpack_vectors


def test_vectors_are_packed_as_base85_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((5, 384)).astype(np.float32)
    vectors[0, :4] = [np.nan, -0.0, np.inf, np.finfo(np.float32).tiny]
    packed = pack_vectors(vectors)
    assert packed.encode() == base64.b85encode(vectors.astype("<f4").tobytes()) and len(packed) == 5 * 1920
    assert unpack_vectors(packed, 5).tobytes() == vectors.tobytes()
