"""The vectors of last user turns: which turns are embedded at all, a small memo of recent ones, and the batcher
that embeds the rest together with other requests' turns.

A semantic hit claims two questions are the same, and that holds only if every part of both was compared: the
embedder reads 256 word pieces and the near-miss guards read `guards.MAX_CHARS` characters, so a longer turn (a
paste, or a 20,000-digit "number" sent to make the guards' work explode) is served by an exact hit or not at
all. It is never embedded, so the embedder and the guards only ever see texts this short, whatever a tenant
sends.

The memo is kept per owner (the tenant): a recent vector skips the batcher's wait and the forward pass, so a memo
shared by every tenant would let one time its own misses and learn which questions another asked lately. Each
owner's memo is an LRU of its own (MEMO_PER_OWNER); the owners are an LRU of MEMO_OWNERS whole memos, so a tenant's
flood of texts evicts only its own vectors (only as many other active tenants as MEMO_OWNERS drop a tenant's memo).
Where a plan isolates its end users, a vector is remembered for the end user too (`user`, the scope's `end_user`),
within the tenant's memo: another end user of the tenant never reads it, and however many end users a tenant names,
they share its one memo (MEMO_PER_OWNER) and evict no other tenant's. A caller that names no owner gets no memo at
all: a forward pass every time, never a vector another left.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import numpy as np

from assets.owner_memo import OwnerMemo
from cache import guards
from cache.batcher import Announcement, EmbeddingBatcher
from cache.embedder import Embedder

SEMANTIC_MAX_CHARS = guards.MAX_CHARS  # the longest last user turn matched by meaning
MEMO_PER_OWNER = 64  # recent turns whose vectors are kept for one owner (a lookup's, then its store's)
MEMO_OWNERS = 128  # owners with a memo at once (the least recently active one's is dropped for a new one)


class TurnVectors:
    """Vectors of last user turns ([dim] float32), or None for turns matched exactly only. Thread-safe."""

    def __init__(self, embedder: Embedder, *, max_batch: int = 32, max_wait_s: float = 0.003) -> None:
        self.embedder = embedder
        self.batcher = EmbeddingBatcher(self.encode_many, max_batch=max_batch, max_wait_s=max_wait_s)
        self._memo: OwnerMemo[np.ndarray] = OwnerMemo(MEMO_PER_OWNER, MEMO_OWNERS)
        self._lock = threading.Lock()

    def embeddable(self, text: str) -> bool:
        """Whether `text` may be matched by meaning: no longer than SEMANTIC_MAX_CHARS and within the word pieces
        the embedder reads. Longer turns are looked up and stored exactly only, never embedded."""
        if not text or len(text) > SEMANTIC_MAX_CHARS:
            return False
        limit = self.embedder.max_tokens
        return len(text) < limit - 2 or self.embedder.num_tokens(text) <= limit

    def recent(self, text: str, owner: Hashable = None, user: Hashable = None) -> np.ndarray | None:
        """`owner`'s recent vector of `text`, remembered for its end user `user` (None: the tenant's own; None for no
        owner: nothing is shared between callers)."""
        if owner is None:
            return None
        with self._lock:
            return self._memo.get(owner, text if user is None else (user, text))

    def _remember(self, text: str, owner: Hashable, vector: np.ndarray | None, user: Hashable = None) -> None:
        if owner is not None and vector is not None:
            with self._lock:
                self._memo.put(owner, text if user is None else (user, text), vector)

    def encode_many(self, texts: list[str]) -> list[np.ndarray | None]:
        """One forward pass for the embeddable texts (None for the others); runs in the caller's thread (the
        batcher's worker, or a synchronous caller's). No memo here: the batcher's texts have many owners."""
        out: list[np.ndarray | None] = [None] * len(texts)
        todo = [i for i, t in enumerate(texts) if self.embeddable(t)]
        if todo:
            for i, vector in zip(todo, self.embedder.encode([texts[i] for i in todo]), strict=True):
                out[i] = vector
        return out

    def get(self, text: str, *, owner: Hashable = None, user: Hashable = None) -> np.ndarray | None:
        """Synchronously, in the caller's thread: `owner`'s (and end user `user`'s) recent vector, else a forward
        pass."""
        if (vector := self.recent(text, owner, user)) is not None:
            return vector
        vector = self.encode_many([text])[0]
        self._remember(text, owner, vector, user)
        return vector

    async def aget(self, text: str, coming: Announcement | None = None, *, owner: Hashable = None,
                   user: Hashable = None) -> np.ndarray | None:
        """On the event loop: `owner`'s recent vector at once, else through the batcher (`coming`: this lookup's
        announcement, closed once its text is queued; `owner`: the tenant, whose texts take turns with others' and
        whose memo alone is read and filled; `user`: its end user, where its plan isolates them, whose part of that
        memo alone is)."""
        if (vector := self.recent(text, owner, user)) is not None:
            return vector
        if not text or len(text) > SEMANTIC_MAX_CHARS:
            return None
        vector = await self.batcher.embed(text, coming, owner=owner)  # the tenant's turn: not one per end user
        self._remember(text, owner, vector, user)
        return vector

    def close(self) -> None:
        self.batcher.close()
