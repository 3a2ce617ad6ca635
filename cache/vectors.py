"""The vectors of last user turns: which turns are embedded at all, a small memo of recent ones, and the batcher
that embeds the rest together with other requests' turns.

A semantic hit claims two questions are the same, and that holds only if every part of both was compared: the
embedder reads 256 word pieces and the near-miss guards read `guards.MAX_CHARS` characters, so a longer turn (a
paste, or a 20,000-digit "number" sent to make the guards' work explode) is served by an exact hit or not at
all. It is never embedded, so the embedder and the guards only ever see texts this short, whatever a tenant
sends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from cache import guards
from cache.batcher import Announcement, EmbeddingBatcher
from cache.embedder import Embedder

SEMANTIC_MAX_CHARS = guards.MAX_CHARS  # the longest last user turn matched by meaning
MEMO_SIZE = 1024  # recent turns whose vectors are kept (a lookup's, then its store's)


class TurnVectors:
    """Vectors of last user turns ([dim] float32), or None for turns matched exactly only. Thread-safe."""

    def __init__(self, embedder: Embedder, *, max_batch: int = 32, max_wait_s: float = 0.003) -> None:
        self.embedder = embedder
        self.batcher = EmbeddingBatcher(self.encode_many, max_batch=max_batch, max_wait_s=max_wait_s)
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def embeddable(self, text: str) -> bool:
        """Whether `text` may be matched by meaning: no longer than SEMANTIC_MAX_CHARS and within the word pieces
        the embedder reads. Longer turns are looked up and stored exactly only, never embedded."""
        if not text or len(text) > SEMANTIC_MAX_CHARS:
            return False
        limit = self.embedder.max_tokens
        return len(text) < limit - 2 or self.embedder.num_tokens(text) <= limit

    def recent(self, text: str) -> np.ndarray | None:
        with self._lock:
            vector = self._memo.get(text)
            if vector is not None:
                self._memo.move_to_end(text)
            return vector

    def encode_many(self, texts: list[str]) -> list[np.ndarray | None]:
        """One forward pass for every text not embedded recently; runs in the caller's thread (the batcher's
        worker, or a synchronous caller's)."""
        out: list[np.ndarray | None] = [self.recent(t) for t in texts]
        todo = [i for i, (t, v) in enumerate(zip(texts, out, strict=True)) if v is None and self.embeddable(t)]
        if todo:
            vectors = self.embedder.encode([texts[i] for i in todo])
            with self._lock:
                for i, vector in zip(todo, vectors, strict=True):
                    out[i] = self._memo[texts[i]] = vector
                while len(self._memo) > MEMO_SIZE:
                    self._memo.popitem(last=False)
        return out

    def get(self, text: str) -> np.ndarray | None:
        """Synchronously, in the caller's thread."""
        return self.encode_many([text])[0]

    async def aget(self, text: str, coming: Announcement | None = None, *, owner: str | None = None,
                   ) -> np.ndarray | None:
        """On the event loop: a recent vector at once, else through the batcher (`coming`: this lookup's
        announcement, closed once its text is queued; `owner`: the tenant, whose texts take turns with others')."""
        if (vector := self.recent(text)) is not None:
            return vector
        if not text or len(text) > SEMANTIC_MAX_CHARS:
            return None
        return await self.batcher.embed(text, coming, owner=owner)

    def close(self) -> None:
        self.batcher.close()
