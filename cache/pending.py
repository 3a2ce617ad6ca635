"""Fresh answers between `SemanticCache.remember` and their write to the store: read your own writes.

The store's write (an embedding, a SQLite or Redis round trip) happens in the background, after the client has
its answer, so a client repeating its request at once would otherwise miss. Until the write is done this
process serves the remembered entry as an exact hit from memory, without a worker thread. A purge or version
bump cancels the pending entries it covers, so their writes never land. Bounded: past `limit` pending entries, or
`per_tenant` of one tenant's, a new one is not remembered, and a repeat of it waits for the store like any other
process's would. The bound per tenant keeps one tenant's flood of new answers (each pending while it is embedded
and queued for the writer) from taking every other tenant's read-your-own-writes: without it, a flood of 10,000
answers in flight left no room for anyone's.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from cache.store import Entry


class PendingWrites:
    """(scope id, exact key) -> the remembered entry, and the ids of cancelled ones. Thread-safe; each call holds
    a lock for microseconds, so the event loop may call it."""

    def __init__(self, limit: int = 10_000, per_tenant: int = 1_000) -> None:
        if limit < 1 or per_tenant < 1:
            raise ValueError("limit and per_tenant must be at least 1")
        self.limit = limit
        self.per_tenant = per_tenant
        self._entries: dict[tuple[str, str], Entry] = {}
        self._per_tenant: Counter[str] = Counter()  # pending entries of each tenant (none kept at zero)
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Entry) -> None:
        key = (entry.scope_id, entry.exact_key)
        with self._lock:
            if key in self._entries:  # the same request answered again: the newer answer, in the older one's place
                self._pop_locked(key)
            elif len(self._entries) >= self.limit or self._per_tenant[entry.tenant] >= self.per_tenant:
                return
            self._entries[key] = entry
            self._per_tenant[entry.tenant] += 1

    def pending_of(self, tenant: str) -> int:
        with self._lock:
            return self._per_tenant.get(tenant, 0)

    def get(self, scope_id: str, exact_key: str) -> Entry | None:
        with self._lock:
            return self._entries.get((scope_id, exact_key))

    def cancel_where(self, drop: Callable[[Entry], bool]) -> None:
        """Cancel every pending entry `drop` selects: no longer served, and its write will not happen."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if drop(e)]:
                self._cancelled.add(self._pop_locked(key).entry_id)

    def cancelled(self, entry: Entry) -> bool:
        with self._lock:
            return entry.entry_id in self._cancelled

    def forget(self, entry: Entry) -> None:
        """The entry's write is over (done, refused or failed): the store answers for it from now on."""
        with self._lock:
            self._cancelled.discard(entry.entry_id)
            if self._entries.get((entry.scope_id, entry.exact_key)) is entry:
                self._pop_locked((entry.scope_id, entry.exact_key))

    def _pop_locked(self, key: tuple[str, str]) -> Entry:
        entry = self._entries.pop(key)
        self._per_tenant[entry.tenant] -= 1
        if not self._per_tenant[entry.tenant]:
            del self._per_tenant[entry.tenant]
        return entry
