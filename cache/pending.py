"""Fresh answers between `SemanticCache.remember` and their write to the store: read your own writes.

The store's write (an embedding, a SQLite or Redis round trip) happens in the background, after the client has
its answer, so a client repeating its request at once would otherwise miss. Until the write is done this
process serves the remembered entry as an exact hit from memory, without a worker thread. A purge or version
bump cancels the pending entries it covers, so their writes never land. Bounded: past `limit` pending entries
a repeat waits for the store like any other process's would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from cache.store import Entry


class PendingWrites:
    """(scope id, exact key) -> the remembered entry, and the ids of cancelled ones. Thread-safe; each call holds
    a lock for microseconds, so the event loop may call it."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._entries: dict[tuple[str, str], Entry] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Entry) -> None:
        with self._lock:
            if len(self._entries) < self.limit:
                self._entries[(entry.scope_id, entry.exact_key)] = entry

    def get(self, scope_id: str, exact_key: str) -> Entry | None:
        with self._lock:
            return self._entries.get((scope_id, exact_key))

    def cancel_where(self, drop: Callable[[Entry], bool]) -> None:
        """Cancel every pending entry `drop` selects: no longer served, and its write will not happen."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if drop(e)]:
                self._cancelled.add(self._entries.pop(key).entry_id)

    def cancelled(self, entry: Entry) -> bool:
        with self._lock:
            return entry.entry_id in self._cancelled

    def forget(self, entry: Entry) -> None:
        """The entry's write is over (done, refused or failed): the store answers for it from now on."""
        with self._lock:
            self._cancelled.discard(entry.entry_id)
            if self._entries.get((entry.scope_id, entry.exact_key)) is entry:
                del self._entries[(entry.scope_id, entry.exact_key)]
