"""Exact hits served from this process's memory (`cache.recent`): no store round trip, and never an answer the
store no longer holds once the change log has been read."""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from cache import Embedder, SemanticCache, SQLiteStore
from cache.recent import RecentEntries
from cache.store import Entry
from tests.cache.conftest import FakeClock, chat, scope

Q = "How do I convert 5 km to miles?"


class CountingStore(SQLiteStore):
    """SQLiteStore counting the exact probes that reach it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.exact_probes = 0

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        self.exact_probes += 1
        return super().find_exact(scope_id, exact_key)


def test_repeated_exact_hits_do_not_reach_the_store(embedder: Embedder, clock: FakeClock) -> None:
    store = CountingStore()
    cache = SemanticCache(store, embedder, clock=clock, sync_interval_s=60.0)
    body = chat(Q)
    cache.store(scope(body), body, "3.1 miles")
    for _ in range(20):
        assert cache.lookup(scope(body), body).status == "hit"
    assert store.exact_probes == 0
    assert cache.stats.exact_hits == 20
    cache.close()


def test_a_delete_by_another_process_is_honoured_after_the_next_sync(tmp_path: Path, embedder: Embedder,
                                                                      clock: FakeClock) -> None:
    path = tmp_path / "cache.sqlite3"
    replica = SemanticCache(SQLiteStore(path), embedder, clock=clock, sync_interval_s=0.05)
    body = chat(Q)
    replica.store(scope(body), body, "3.1 miles")
    assert replica.lookup(scope(body), body).status == "hit"
    other = SemanticCache(SQLiteStore(path), embedder, clock=clock, sync_interval_s=0.05)
    assert other.purge("acme") == 1
    time.sleep(0.06)  # the replica's sync is due: the next lookup reads the change log first
    assert replica.lookup(scope(body), body).status == "miss"
    assert replica.lookup(scope(body), body).status == "miss"
    for c in (replica, other):
        c.close()


def test_own_purge_and_expiry_drop_remembered_entries(embedder: Embedder, clock: FakeClock) -> None:
    cache = SemanticCache(SQLiteStore(), embedder, clock=clock, sync_interval_s=60.0)
    body = chat(Q)
    cache.store(scope(body), body, "3.1 miles")
    assert cache.lookup(scope(body), body).status == "hit"
    cache.purge("acme")
    assert cache.lookup(scope(body), body).status == "miss"
    cache.store(scope(body), body, "3.1 miles", ttl_s=10)
    clock.now += 11
    assert cache.lookup(scope(body), body).status == "miss"
    cache.close()


def _entry(i: int, expires_at: float | None = None) -> Entry:
    return Entry(entry_id=f"e{i}", scope_id="s", tenant="acme", data_version="1", model_version="m",
                 exact_key=f"k{i}", partition="p", semantic_text="", response=f"a{i}", expires_at=expires_at)


def test_recent_entries_are_bounded_and_least_recently_used_goes_first() -> None:
    recent = RecentEntries(limit=3)
    for i in range(3):
        recent.put(_entry(i))
    assert recent.get("s", "k0", now=1.0) is not None  # k0 is now the most recently used
    recent.put(_entry(3))
    assert len(recent) == 3
    assert recent.get("s", "k1", now=2.0) is None
    assert recent.get("s", "k0", now=2.0) is not None
    assert recent.take_used() == {"e0": 2.0}
    assert recent.take_used() == {}
    recent.drop_ids(["e0", "unknown"])
    assert recent.get("s", "k0", now=3.0) is None
    recent.put(_entry(9, expires_at=5.0))
    assert recent.get("s", "k9", now=5.0) is None and len(recent) == 2  # expired: dropped on sight


class LockedLogStore(SQLiteStore):
    """SQLiteStore whose change log cannot be read while `locked` (another process holds the file)."""

    locked = False
    refused = 0

    def changes_since(self, cursor: int, limit: int = 1000) -> tuple[int, list[tuple[str, str, str]]]:
        if self.locked:
            self.refused += 1
            raise sqlite3.OperationalError("database is locked")
        return super().changes_since(cursor, limit)  # type: ignore[return-value]


def test_a_catch_up_that_failed_earns_no_trust_in_remembered_entries(tmp_path: Path, embedder: Embedder,
                                                                     clock: FakeClock) -> None:
    """Another process purged an entry; this one's catch-up then failed: the failed try counted as a catch-up, so
    for `sync_interval_s` after each failure the entry was served from memory, deleted, and a store locked again and
    again kept it so. Now a failed catch-up trusts nothing: the lookup asks the store, which has no entry."""
    path = tmp_path / "cache.sqlite3"
    store = LockedLogStore(path)
    replica = SemanticCache(store, embedder, clock=clock, sync_interval_s=60.0)
    body = chat(Q)
    replica.store(scope(body), body, "3.1 miles")
    assert replica.lookup(scope(body), body).status == "hit"
    other = SemanticCache(SQLiteStore(path), embedder, clock=clock, sync_interval_s=60.0)
    assert other.purge("acme") == 1
    replica.feed._last = replica.feed._tried = -math.inf  # a minute on: the replica's catch-up is due
    store.locked = True
    replica.lookup(scope(body), body)  # queues the catch-up for the writer thread, where it fails
    assert replica.writes.last_sync is not None and replica.writes.last_sync.result(timeout=10) == 0
    store.locked = False
    assert store.refused == 1
    assert replica.lookup(scope(body), body).status == "miss"  # was a hit: the purged entry, from memory
    assert not replica.feed.recent()
    for c in (replica, other):
        c.close()


class RacingStore(SQLiteStore):
    """A store whose exact read is followed at once by another process's deletion of the entry, applied by this one's
    writer thread (`recent.drop_ids`), before the lookup can remember what it read."""

    deleted: Callable[[Entry], None] = staticmethod(lambda entry: None)

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        found = super().find_exact(scope_id, exact_key)
        if found is not None:
            self.deleted(found)
        return found


def test_an_entry_deleted_while_a_lookup_read_it_is_not_remembered(embedder: Embedder, clock: FakeClock) -> None:
    """The deletion came when the entry was not in the map yet (nothing to drop); put after it, it was served from
    memory while the change log was trusted, as long as the map kept it."""
    store = RacingStore()
    cache = SemanticCache(store, embedder, clock=clock, sync_interval_s=60.0)
    body = chat(Q)
    cache.store(scope(body), body, "3.1 miles")
    cache.recent.clear()  # (as after a restart: only the store holds it)
    store.deleted = lambda entry: cache.recent.drop_ids([entry.entry_id])
    assert cache.lookup(scope(body), body).status == "hit"  # read before the deletion: served once
    assert len(cache.recent) == 0  # but not remembered
    store.deleted = lambda entry: None
    assert cache.lookup(scope(body), body).status == "hit"
    assert len(cache.recent) == 1  # no deletion in between: remembered
    cache.close()
