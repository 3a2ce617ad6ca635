"""Where one process stands in a shared store's change log, and how recently it caught up.

Several gateway processes share one cache store; each keeps its own faiss index and its own map of recent
entries, so each applies the others' writes and deletes from the store's change log (`CacheStore.changes_since`).
The cache catches up at most every `interval_s` (`due`), in its writer thread, never in a lookup's
(cache/entry_writes.py `sync_soon`); while the last catch-up that worked is that recent, the cache
may trust its map of recent entries (cache/recent.py), as no deletion elsewhere is older than it and still
unapplied. One that failed (the store down or locked) is tried again after `interval_s` too, but earns no trust.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cache.store import CacheStore

# (op, entry id, partition): op is "put", "del", or "reset" (the log was cut past the cursor: rebuild).
Change = tuple[str, str, str]


class ChangeFeed:
    """A cursor into the store's change log, taken when the feed is made: make it before loading the index, so
    no write in between is missed."""

    def __init__(self, store: CacheStore, interval_s: float):
        self.store = store
        self.interval_s = interval_s
        self._cursor = store.change_cursor()
        self._last = self._tried = time.monotonic()  # when the last catch-up that worked, and the last one, began
        self._lock = threading.Lock()

    def recent(self) -> bool:
        """True while the last catch-up that worked began less than `interval_s` ago."""
        return time.monotonic() - self._last < self.interval_s

    def due(self) -> bool:
        """True once the last catch-up, whether it worked or not, began `interval_s` ago or more."""
        return time.monotonic() - self._tried >= self.interval_s

    def catch_up(self, apply: Callable[[list[Change]], None], before: Callable[[], None] = lambda: None) -> int:
        """Call `apply` on every change since the cursor, in order, a page of the log at a time (so it can read
        what the page's puts need in a few batched reads), then move the cursor past them. Returns how many. One
        thread at a time: a caller waits for a catch-up in progress (the writer thread's), then applies what is left
        (none of the changes twice). `before` runs first, under the same exclusion."""
        with self._lock:
            began = self._tried = time.monotonic()
            before()
            applied = 0
            while True:
                cursor, changes = self.store.changes_since(self._cursor)
                if not changes:
                    self._last = began
                    return applied
                apply(changes)
                applied += len(changes)
                self._cursor = cursor
