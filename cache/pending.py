"""Fresh answers between `SemanticCache.remember` and their write to the store: read your own writes.

The store's write (an embedding, a SQLite or Redis round trip) happens in the background, after the client has
its answer, so a client repeating its request at once would otherwise miss. Until the write is done this
process serves the remembered entry as an exact hit from memory, without a worker thread. A purge or version
bump cancels the pending entries it covers, so their writes never land. Bounded: past `limit` pending entries, or
`per_tenant` of one tenant's, a new one is not remembered, and a repeat of it waits for the store like any other
process's would. The bound per tenant keeps one tenant's flood of new answers (each pending while it is embedded
and queued for the writer) from taking every other tenant's read-your-own-writes: without it, a flood of 10,000
answers in flight left no room for anyone's. The same holds of their size (`store.entry_bytes`): `max_bytes` in all
and `per_tenant_bytes` of one tenant's, so 1,000 long answers of one tenant cannot hold a gigabyte.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from cache.store import Entry, entry_bytes

MAX_BYTES = 64 << 20  # what the pending entries hold at most, all tenants' (`store.entry_bytes`)
PER_TENANT_BYTES = 16 << 20  # of which one tenant's


class PendingWrites:
    """(scope id, exact key) -> the remembered entry, and the ids of cancelled ones. Thread-safe; each call holds
    a lock for microseconds, so the event loop may call it."""

    def __init__(self, limit: int = 10_000, per_tenant: int = 1_000, *, max_bytes: int = MAX_BYTES,
                 per_tenant_bytes: int = PER_TENANT_BYTES) -> None:
        if min(limit, per_tenant, max_bytes, per_tenant_bytes) < 1:
            raise ValueError("limit, per_tenant and the byte bounds must be at least 1")
        self.limit = limit
        self.per_tenant = per_tenant
        self.max_bytes = max_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self.num_bytes = 0  # of the pending entries (`entry_bytes`)
        self._entries: dict[tuple[str, str], tuple[Entry, int]] = {}  # with its size as added
        self._per_tenant: Counter[str] = Counter()  # pending entries of each tenant (none kept at zero)
        self._tenant_bytes: Counter[str] = Counter()  # and their sizes
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Entry) -> None:
        key = (entry.scope_id, entry.exact_key)
        size = entry_bytes(entry)
        with self._lock:
            if key in self._entries:  # the same request answered again: the newer answer, in the older one's place
                self._pop_locked(key)
            elif len(self._entries) >= self.limit or self._per_tenant[entry.tenant] >= self.per_tenant:
                return
            if self.num_bytes + size > self.max_bytes \
                    or self._tenant_bytes[entry.tenant] + size > self.per_tenant_bytes:
                return
            self._entries[key] = (entry, size)
            self._per_tenant[entry.tenant] += 1
            self._tenant_bytes[entry.tenant] += size
            self.num_bytes += size

    def pending_of(self, tenant: str) -> int:
        with self._lock:
            return self._per_tenant.get(tenant, 0)

    def get(self, scope_id: str, exact_key: str) -> Entry | None:
        with self._lock:
            found = self._entries.get((scope_id, exact_key))
        return found[0] if found is not None else None

    def cancel_where(self, drop: Callable[[Entry], bool]) -> None:
        """Cancel every pending entry `drop` selects: no longer served, and its write will not happen."""
        with self._lock:
            for key in [k for k, (e, _) in self._entries.items() if drop(e)]:
                self._cancelled.add(self._pop_locked(key).entry_id)

    def cancelled(self, entry: Entry) -> bool:
        with self._lock:
            return entry.entry_id in self._cancelled

    def forget(self, entry: Entry) -> None:
        """The entry's write is over (done, refused or failed): the store answers for it from now on."""
        with self._lock:
            self._cancelled.discard(entry.entry_id)
            found = self._entries.get((entry.scope_id, entry.exact_key))
            if found is not None and found[0] is entry:
                self._pop_locked((entry.scope_id, entry.exact_key))

    def _pop_locked(self, key: tuple[str, str]) -> Entry:
        entry, size = self._entries.pop(key)
        self._per_tenant[entry.tenant] -= 1
        self._tenant_bytes[entry.tenant] -= size
        self.num_bytes -= size
        if not self._per_tenant[entry.tenant]:
            del self._per_tenant[entry.tenant]
            del self._tenant_bytes[entry.tenant]
        return entry
