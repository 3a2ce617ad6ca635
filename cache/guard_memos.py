"""The near-miss guards' memos (cache/guards.py): what a text reads as (`comparable`) and its features (`extract`),
remembered per owner, as the vector and meaning-check memos are (assets/owner_memo.py).

An owner is the tenant, and within it the end user where its plan isolates them (`user`). A text costs up to ~1.5 ms
to read at the guards' MAX_CHARS and ~1 µs once remembered, so a memo shared by every tenant (as it was: one LRU of
8,192 texts keyed by the text alone) let one tenant time its lookups to learn whether another's text was read lately,
and one tenant's flood of texts evicted everyone's. Each owner's memo holds up to MEMO_PER_OWNER texts, evicted by its
own; MEMO_OWNERS owners' memos are kept, the least recently active one's dropped for a new one, and MEMO_TEXTS texts
in all, past which the least recently active owner's oldest go (so one busy tenant is not held to 8,192 / 64 texts,
which no hot set fits: an LRU cycled past its size remembers nothing, measured at 201 µs a check with 400 texts in
turn against ~3 µs remembered). A caller that names no owner gets no memo: the work every time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from assets.owner_memo import OwnerMemo

# Texts remembered for one owner (a tenant: its end users' share it), owners remembered at once, and texts in all
# (8,192, as the one shared memo held)
MEMO_PER_OWNER = 2048
MEMO_OWNERS = 64
MEMO_TEXTS = 8192

F = TypeVar("F")  # what the guards extract of a text (cache/guards.py's Features)
R = TypeVar("R")


class GuardMemos(Generic[F]):
    """What texts read as and their features, per owner (OwnerMemo: one LRU per owner, owners in LRU order). The
    work runs outside the lock; two threads reading one new text may both do it (the same result either way)."""

    def __init__(self) -> None:
        self.reads: OwnerMemo[str] = OwnerMemo(MEMO_PER_OWNER, MEMO_OWNERS, MEMO_TEXTS)
        self.features: OwnerMemo[F] = OwnerMemo(MEMO_PER_OWNER, MEMO_OWNERS, MEMO_TEXTS)
        self._lock = threading.Lock()

    def remembered(self, memo: OwnerMemo[R], work: Callable[[str], R], text: str, owner: Hashable,
                   user: Hashable) -> R:
        """`work(text)`, remembered in `memo` for `owner` (under `user` within it); no memo without an owner."""
        if owner is None:
            return work(text)
        key = text if user is None else (user, text)
        with self._lock:
            found = memo.get(owner, key)
        if found is None:
            found = work(text)
            with self._lock:
                memo.put(owner, key, found)
        return found

    def clear(self) -> None:
        with self._lock:
            self.reads = OwnerMemo(MEMO_PER_OWNER, MEMO_OWNERS, MEMO_TEXTS)
            self.features = OwnerMemo(MEMO_PER_OWNER, MEMO_OWNERS, MEMO_TEXTS)
