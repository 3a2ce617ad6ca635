"""`ReadCache`: the tenant store's read cache of keys and data versions, so that a request costs no query.

It is emptied whenever anyone commits a change: SQLite's `PRAGMA data_version` changes when another connection (the
CLI, another gateway process) commits, so a revocation takes effect on the next request; PostgreSQL's replicas hear of
each change through LISTEN/NOTIFY and a change counter, within milliseconds (a second at most). A key id not cached (a
key's first use, or one made up: no key is needed to send one) is looked up by `authenticate_async` off the event loop
wherever that query waits on a network (PostgreSQL), so a flood of made-up ids never stalls the loop that serves
everyone else. So is a tenant's data version not cached (`data_version_async`, the cache stage's): every write empties
every tenant's, and each reads it again.

The store (gateway/tenants/store.py) supplies the reads themselves (`_fetch_entry`, `_fetch_version`) and how it
learns that another connection committed (`_changed_elsewhere`); this class decides what is cached and when it is
dropped.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from gateway.tenants.keys import parse_key, verify
from gateway.tenants.records import ApiKey, Principal, Tenant

MAX_CACHED = 100_000  # cached key ids of each kind (keys, unknown ids); past it that cache starts again (bounded)

_Entry = tuple[str, ApiKey, Tenant | None]  # a key's stored hash, the key, its tenant
_MISS = object()  # `_cached`'s answer for a key id it holds no answer for


class ReadCache(ABC):
    """Keys and data versions as last read, dropped at every commit; see the module docstring."""

    def __init__(self) -> None:
        # by key id: the keys there are, and apart from them the ids of none, so that a flood of made-up ids
        # (no key needed to send one) empties only its own cache, never the real keys' (each a query again)
        self._cache: dict[str, _Entry] = {}
        self._unknown: dict[str, None] = {}
        self._versions: dict[str, int] = {}
        self._generation = 0  # bumped at each emptying, so a read that raced one is not cached

    # ---- what the store supplies ----

    @abstractmethod
    def _fetch_entry(self, key_id: str) -> _Entry | None:
        """What a lookup of `key_id` finds, as stored (None: no such key); any thread may call it."""

    @abstractmethod
    def _fetch_version(self, tenant: str) -> int:
        """The tenant's data version as stored; any thread may call it."""

    @abstractmethod
    def _changed_elsewhere(self) -> bool:
        """Whether another connection committed since this was last asked (True when it cannot tell)."""

    # ---- data versions ----

    def data_version(self, tenant: str, *, follow: bool = True) -> int:
        """The tenant's data version: cached answers from an older one are never served. `follow=False` skips
        asking whether another connection committed, for a caller that just did. A version not cached is a query on
        the calling thread: from the event loop, `data_version_async` is the one to call."""
        if follow:
            self._follow()
        version = self._versions.get(tenant)  # emptied with the key cache whenever anyone writes
        return self._load_version(tenant) if version is None else version

    async def data_version_async(self, tenant: str) -> int:
        """`data_version` for the event loop, without following (the request's `authenticate_async` just did): a
        cached version costs no await; one not cached is `_version_lookup`'s, which a store whose queries wait on a
        network runs off the loop. Any write empties every tenant's cached version, so after each one every tenant's
        next cacheable request asks: on the loop, one waiting on a lock (seconds) stalled every tenant's requests."""
        version = self._versions.get(tenant)
        return await self._version_lookup(tenant) if version is None else version

    async def _version_lookup(self, tenant: str) -> int:
        """A version not cached, read for the event loop: here on it (SQLite's query is local, ~0.1 ms)."""
        return self._load_version(tenant)

    def _load_version(self, tenant: str) -> int:
        generation = self._generation
        version = self._fetch_version(tenant)
        self._keep_version(tenant, version, generation)
        return version

    def _keep_version(self, tenant: str, version: int, generation: int) -> None:
        """Cache a version read, unless someone committed since the read began (`generation` is from then): it may
        be older than theirs."""
        if generation == self._generation:
            if len(self._versions) >= MAX_CACHED:
                self._versions.clear()
            self._versions[tenant] = version

    # ---- keys ----

    def authenticate(self, presented: str) -> Principal | None:
        """The principal for a presented key, or None (unknown, wrong secret, revoked, expired). A key id not
        cached is a query on the calling thread: from the event loop, `authenticate_async` is the one to call."""
        parsed = parse_key(presented)
        entry = self._cached(parsed)
        if entry is _MISS:
            entry = self._load(parsed[0])  # type: ignore[index]
        return _principal(presented, entry)  # type: ignore[arg-type]

    async def authenticate_async(self, presented: str) -> Principal | None:
        """`authenticate` for the event loop: a cached key costs no await; a key id not cached is `_lookup`'s,
        which a store whose queries wait on a network runs off the loop (anyone can send a made-up id)."""
        parsed = parse_key(presented)
        entry = self._cached(parsed)
        if entry is _MISS:
            entry = await self._lookup(parsed[0])  # type: ignore[index]
        return _principal(presented, entry)  # type: ignore[arg-type]

    def _cached(self, parsed: tuple[str, str] | None) -> _Entry | object | None:
        """The cached entry of a parsed key, None when it is known not to exist, `_MISS` when not cached."""
        self._follow()
        if not parsed:
            return None
        entry = self._cache.get(parsed[0])
        return _MISS if entry is None and parsed[0] not in self._unknown else entry

    async def _lookup(self, key_id: str) -> _Entry | None:
        """A key id not cached, looked up for the event loop: here on it (SQLite's query is local, ~0.1 ms)."""
        return self._load(key_id)

    def _load(self, key_id: str) -> _Entry | None:
        generation = self._generation
        entry = self._fetch_entry(key_id)
        self._keep(key_id, entry, generation)
        return entry

    def _keep(self, key_id: str, entry: _Entry | None, generation: int) -> None:
        """Cache what a lookup found, unless someone committed since it began (`generation` is from then)."""
        if generation == self._generation:
            cache: dict[str, Any] = self._cache if entry is not None else self._unknown
            if len(cache) >= MAX_CACHED:
                cache.clear()
            cache[key_id] = entry

    def _follow(self) -> None:
        """Empty the caches if another connection (the CLI, another process or replica) committed a change."""
        if self._changed_elsewhere():
            self._invalidate()

    def _invalidate(self) -> None:
        self._generation += 1
        self._cache.clear()
        self._unknown.clear()
        self._versions.clear()


def _principal(presented: str, entry: _Entry | None) -> Principal | None:
    """The principal if `presented` is the entry's key and the key is active. The hash is compared whatever the
    entry (constant time; an unknown id costs what a wrong secret does)."""
    if not verify(presented, entry[0] if entry else None) or entry is None:
        return None
    _, key, tenant = entry
    return Principal(key, tenant) if key.active(time.time()) else None
