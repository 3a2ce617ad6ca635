"""Where cache entries live: the `CacheStore` boundary (its embedded implementation, `SQLiteStore`, is
cache/sqlite_store.py; the shared one, `RedisStore`, cache/redis_store.py).

What crosses this boundary: whole `Entry` rows in, `Entry` rows or entry ids out. The store owns TTL
expiry, the bounds on its size and purges; it returns the ids it removed so the caller can drop them from its
vector index. The vector of each entry is stored with it, so a restarted process rebuilds its faiss indexes
from the store without re-embedding anything. A shared (Redis) store implements the same methods;
`SQLiteStore(":memory:")` serves tests and benchmarks.

Two bounds, so one tenant cannot evict everyone's answers: a tenant over `max_entries_per_tenant` entries or over
`max_bytes_per_tenant` bytes (`stored_bytes`: a count alone let a tenant of long answers hold gigabytes) loses its
own least recently used entries, and a store over `max_entries` evicts from the tenant holding the most (its least
recently used first). A flooding tenant thus evicts only itself once it is the largest. An entry larger than its
tenant's byte budget on its own is not written.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAX_BYTES_PER_TENANT = 256 << 20  # one tenant's entries at most (`stored_bytes`): ~25,000 answers of 10 KB


class CacheStoreError(Exception):
    """The cache store could not be read or written (bad path, disk full, corrupt file)."""


@dataclass(slots=True)
class Entry:
    """One cached answer and everything needed to decide whether it may be served."""

    entry_id: str
    scope_id: str
    tenant: str
    data_version: str
    model_version: str
    exact_key: str  # request_key.RequestKey.exact_key
    partition: str  # scope id + history hash: the faiss partition of its semantic text
    semantic_text: str  # the last user turn, for the guards
    response: str  # the assistant's answer text
    usage: dict[str, Any] = field(default_factory=dict)  # the OpenAI usage of the original answer
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. finish_reason, the tier and model that answered
    created_at: float = 0.0
    expires_at: float | None = None  # None: no TTL
    last_used: float = 0.0
    embedding: np.ndarray | None = None  # [dim] float32, None when the entry is exact-only
    # the end user its scope isolates (CacheScope.end_user), whose memo alone its embedding may fill (not stored)
    end_user: str | None = field(default=None, compare=False)


def entry_bytes(entry: Entry) -> int:
    """About what an entry holds in memory: its texts (a character counted as a byte) and its vector, plus its keys
    and fields. What the in-memory maps of entries (cache/recent.py, cache/pending.py) bound besides their counts:
    an answer may be hundreds of kilobytes, and a count alone let one tenant's long answers hold gigabytes."""
    vector = 0 if entry.embedding is None else int(entry.embedding.nbytes)
    return len(entry.response) + len(entry.semantic_text) + vector + 512


def stored_bytes(entry: Entry) -> int:
    """What an entry takes in a store, the measure of `max_bytes_per_tenant`: the UTF-8 bytes of its texts (its ids,
    keys, versions, question and answer, its usage and metadata as JSON) and its vector's. A store's own overhead
    per row is left out; `max_entries_per_tenant` bounds that."""
    texts = (entry.entry_id, entry.scope_id, entry.tenant, entry.data_version, entry.model_version, entry.exact_key,
             entry.partition, entry.semantic_text, entry.response, json.dumps(entry.usage), json.dumps(entry.metadata))
    vector = 0 if entry.embedding is None else int(np.asarray(entry.embedding, dtype=np.float32).nbytes)
    return sum(len(t.encode("utf-8", "replace")) for t in texts) + vector


class CacheStore(ABC):
    """Entries by id and by (scope, exact key), bounded by LRU, selectable by tenant and version."""

    max_entries: int
    max_entries_per_tenant: int
    max_bytes_per_tenant: int | None  # None: no byte bound

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def put(self, entry: Entry) -> list[str] | None:
        """Insert `entry`, replacing the one with the same scope and exact key; return every id displaced. None: not
        written, as it was made before its tenant's data was bumped past its version (`drop_data_versions`, by any
        process: an answer still being written elsewhere then must not land after the deletion), or as it is larger
        than its tenant's byte budget on its own (`stored_bytes`)."""

    @abstractmethod
    def get(self, entry_id: str) -> Entry | None: ...

    @abstractmethod
    def vectors_of(self, entry_ids: Iterable[str]) -> list[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of those of `entry_ids` stored with a vector, in their order: what another
        process's writes add to this one's index (cache/entry_writes.py), read in batches, never the entries' texts."""

    @abstractmethod
    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None: ...

    @abstractmethod
    def touch(self, entry_id: str, now: float) -> None:
        """Mark an entry used (for LRU eviction)."""

    @abstractmethod
    def delete(self, entry_ids: Iterable[str]) -> list[str]:
        """Delete entries; return the ids that existed."""

    @abstractmethod
    def ids_of_tenant(self, tenant: str | None, limit: int | None = None) -> list[str]:
        """Ids of a tenant's entries (every entry with None)."""

    @abstractmethod
    def ids_not_at_data_version(self, tenant: str, data_version: str, created_before: float, limit: int) -> list[str]:
        """Ids of a tenant's entries created before a bump at another data version than the bumped one."""

    @abstractmethod
    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]: ...

    @abstractmethod
    def model_versions(self) -> set[str]:
        """The model versions of every entry (a scan of the store: once at start-up, not per request)."""

    @abstractmethod
    def expired(self, now: float, limit: int = 1000) -> list[str]: ...

    @abstractmethod
    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of every entry with an embedding."""

    @abstractmethod
    def close(self) -> None: ...

    def change_cursor(self) -> str:
        """Where the change log ends now; a store only one process writes has none."""
        return ""

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[tuple[str, str, str]]]:
        """(new cursor, [(op, entry id, partition)]) written after `cursor` by any process: op 'put' (an entry
        with a vector), 'del', or 'reset' (the log no longer reaches back to `cursor`: reload every vector). At most
        `limit`; fewer only where the log ends (cache/change_feed.py takes a short page as caught up)."""
        return cursor, []

    def checkpoint_due(self) -> bool:
        """Whether the store has written enough since its last `checkpoint` to want one (a SQLite file's WAL)."""
        return False

    def checkpoint(self) -> None:
        """Copy what was written into the store proper (SQLite's WAL into the file), off the lookups' path: the
        cache's writer thread calls it when `checkpoint_due`. Nothing to do for most stores."""
        return None

    def drop_data_versions(self, tenant: str, current: str, created_before: float, batch: int = 500) -> list[str]:
        """Delete the tenant's entries created before `created_before` at another data version than `current`
        (after a data-version bump), in batches, and refuse such entries from now on (`put`: every process's late
        writes). Returns the ids deleted."""
        gone: list[str] = []
        while ids := self.ids_not_at_data_version(tenant, current, created_before, batch):
            deleted = self.delete(ids)
            gone += deleted
            if not deleted:
                break
        return gone


def open_cache_store(*, sqlite_path: str | Path, redis_url: str | None = None, max_entries: int = 100_000,
                     max_entries_per_tenant: int | None = None,
                     max_bytes_per_tenant: int | None = MAX_BYTES_PER_TENANT) -> CacheStore:
    """The store a deployment shares: Redis when `redis_url` is set, else the SQLite file (the gateway and the
    CLI open the same one)."""
    if redis_url:
        from cache.redis_store import RedisStore

        return RedisStore(redis_url, max_entries=max_entries, max_entries_per_tenant=max_entries_per_tenant,
                          max_bytes_per_tenant=max_bytes_per_tenant)
    from cache.sqlite_store import SQLiteStore

    return SQLiteStore(sqlite_path, max_entries=max_entries, max_entries_per_tenant=max_entries_per_tenant,
                       max_bytes_per_tenant=max_bytes_per_tenant)


def check_bounds(max_entries: int, max_entries_per_tenant: int | None, max_bytes_per_tenant: int | None) -> None:
    """A store's bounds, each at least 1 (None: that bound is off)."""
    if max_entries < 1 or any(bound is not None and bound < 1 for bound in (max_entries_per_tenant,
                                                                            max_bytes_per_tenant)):
        raise ValueError("max_entries, max_entries_per_tenant and max_bytes_per_tenant must be at least 1")
