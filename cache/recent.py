"""Entries this process wrote or read lately, by (scope id, exact key): an exact hit served from memory.

An exact hit otherwise costs a worker thread and a store round trip (a SQLite query or a Redis call, and a write to
mark the entry used) for an answer this process very likely handled a moment ago. The cache keeps this map in step
with the store: its own deletions (purge, version bump, expiry, eviction) drop entries at once, and other processes'
deletions arrive through the store's change log, a catch-up with which a lookup queues every `sync_interval_s` and
the cache's writer thread applies when it reaches it (cache/entry_writes.py `sync_soon`); the cache consults this
map only while the last catch-up that worked began less than `sync_interval_s` ago (cache/change_feed.py `recent`),
so an entry deleted elsewhere is served from here for at most that long. The LRU marks of entries served from memory
are kept here and written to the store at the next catch-up. Bounded: the least recently used entry goes when
`limit` is reached, and a tenant's own least recently used one when it holds `per_tenant`: one tenant's flood of new
answers pushes out its own entries, not every other tenant's (whose exact hits would then each pay a worker thread
and a store round trip). The same holds of their size (`store.entry_bytes`): `max_bytes` in all, `per_tenant_bytes`
of one tenant's (an entry larger than that is not kept here at all). Counted alone, 10,000 answers of 100 KB (one
tenant asking for long ones) held a gigabyte.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from cache.store import Entry, entry_bytes

MAX_BYTES = 64 << 20  # what the entries kept here hold at most, all tenants' (`store.entry_bytes`)
PER_TENANT_BYTES = 16 << 20  # of which one tenant's


class RecentEntries:
    """A bounded LRU of entries by (scope id, exact key), and their pending LRU marks. Thread-safe; each call
    holds a lock for microseconds (except `drop_where`, linear in the map, run on rare admin changes)."""

    def __init__(self, limit: int = 10_000, per_tenant: int = 2_500, *, max_bytes: int = MAX_BYTES,
                 per_tenant_bytes: int = PER_TENANT_BYTES) -> None:
        if min(limit, per_tenant, max_bytes, per_tenant_bytes) < 1:
            raise ValueError("limit, per_tenant and the byte bounds must be at least 1")
        self.limit = limit
        self.per_tenant = per_tenant
        self.max_bytes = max_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self.num_bytes = 0  # of the entries kept (`entry_bytes`)
        self._tenant_bytes: dict[str, int] = {}
        self._entries: OrderedDict[tuple[str, str], Entry] = OrderedDict()
        # each tenant's keys, least recent first, with each entry's size (`entry_bytes`, as it was put)
        self._of_tenant: dict[str, OrderedDict[tuple[str, str], int]] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # entry id -> its key in _entries
        self._used: dict[str, float] = {}  # entry id -> when it was last served from here
        # counts the drops of deleted entries (`drop_ids`, `drop_where`, `clear`; not evictions): a lookup that read
        # an entry from the store puts it here only if none came since its read (`put`'s `seen`), or a deletion
        # applied in between (another process's, by the writer thread) would have nothing to drop yet, and the entry
        # put after it would be served from here while the feed is trusted
        self.generation = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, scope_id: str, exact_key: str, now: float) -> Entry | None:
        """The entry for the key, marked used at `now`; None if absent or expired (an expired one is dropped,
        and the store path deletes it)."""
        key = (scope_id, exact_key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.expires_at is not None and entry.expires_at <= now:
                self._drop_locked(key)
                return None
            self._entries.move_to_end(key)
            self._of_tenant[entry.tenant].move_to_end(key)
            self._used[entry.entry_id] = now
            return entry

    def put(self, entry: Entry, seen: int | None = None) -> None:
        """Remember `entry`; with `seen` (the `generation` read before the entry was read from the store), only if
        no deletion was dropped since."""
        key = (entry.scope_id, entry.exact_key)
        with self._lock:
            if seen is not None and seen != self.generation:
                return  # it may be deleted since it was read: the store serves it next time, if it is still there
            used = self._used.get(entry.entry_id)  # the same entry again keeps its mark
            if key in self._entries:  # counted anew (a scope is one tenant's)
                self._drop_locked(key)
            if used is not None:
                self._used[entry.entry_id] = used
            size = entry_bytes(entry)
            if size > min(self.per_tenant_bytes, self.max_bytes):
                return  # the store serves it: alone, it would push out every other entry of its tenant
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._keys[entry.entry_id] = key
            own = self._of_tenant.setdefault(entry.tenant, OrderedDict())
            own[key] = size
            own.move_to_end(key)
            self.num_bytes += size
            self._tenant_bytes[entry.tenant] = self._tenant_bytes.get(entry.tenant, 0) + size
            while len(own) > self.per_tenant or self._tenant_bytes[entry.tenant] > self.per_tenant_bytes:
                self._drop_locked(next(iter(own)))
            while len(self._entries) > self.limit or self.num_bytes > self.max_bytes:
                self._drop_locked(next(iter(self._entries)))

    def drop_ids(self, entry_ids: Iterable[str]) -> None:
        with self._lock:
            self.generation += 1  # held or not: one read before now may be putting it
            for entry_id in entry_ids:
                key = self._keys.get(entry_id)
                if key is not None:
                    self._drop_locked(key)

    def drop_where(self, drop: Callable[[Entry], bool]) -> None:
        with self._lock:
            self.generation += 1
            for key in [k for k, e in self._entries.items() if drop(e)]:
                self._drop_locked(key)

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()
            self._keys.clear()
            self._used.clear()
            self._of_tenant.clear()
            self._tenant_bytes.clear()
            self.num_bytes = 0

    def take_used(self) -> dict[str, float]:
        """The LRU marks gathered since the last call (entry id -> last use), for the store."""
        with self._lock:
            used, self._used = self._used, {}
            return used

    def _drop_locked(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key)
        self._keys.pop(entry.entry_id, None)
        self._used.pop(entry.entry_id, None)
        own = self._of_tenant[entry.tenant]
        size = own.pop(key)
        self.num_bytes -= size
        self._tenant_bytes[entry.tenant] -= size
        if not own:
            del self._of_tenant[entry.tenant]
            del self._tenant_bytes[entry.tenant]
