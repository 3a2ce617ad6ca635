"""SQLite's WAL checkpoints run in the cache's writer thread, never inside a lookup's commit, and the WAL stays
bounded by them, under a flood of writes and under a workload of hits alone.

SQLite's automatic checkpoint runs inside whichever COMMIT takes the WAL past 1,000 pages; a lookup's LRU mark
(`SQLiteStore.touch`) commits on the store's write connection, so now and then a lookup waited out a whole
checkpoint."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from bench.cache_write_contention import HashEmbedder
from cache.results import Hit
from cache.semantic_cache import SemanticCache
from cache.sqlite_store import SQLiteStore
from tests.cache.conftest import chat, scope

PAGE = 4096 + 24  # a WAL frame: a page and its header
WAL_BOUND = 4000 * PAGE  # a checkpoint every 100 rows is ~1,300 frames; without one, 1,500 puts write ~19,000


def wal_size(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_no_connection_a_lookup_writes_or_reads_on_checkpoints_by_itself(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "cache.db")
    # the write connection, which a lookup's touch commits on, and a read connection
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    with store._reading() as db:
        assert db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    store.close()


async def test_the_writer_thread_checkpoints_and_keeps_the_wal_bounded(tmp_path: Path) -> None:
    path = tmp_path / "cache.db"
    store = SQLiteStore(path, max_entries=100_000)
    cache = SemanticCache(store, HashEmbedder())
    ran_in: list[str] = []
    checkpoint = store.checkpoint

    def recorded() -> None:
        ran_in.append(threading.current_thread().name)
        checkpoint()

    store.checkpoint = recorded  # type: ignore[method-assign]
    bodies = [chat(f"question {i}") for i in range(1500)]
    scopes = [scope(chat("q"), tenant=f"tenant-{i % 3}") for i in range(3)]
    in_flight = asyncio.Semaphore(16)

    async def write(i: int) -> None:
        async with in_flight:
            assert await cache.astore(scopes[i % 3], bodies[i], f"answer {i}" * 20) is not None

    await asyncio.gather(*(write(i) for i in range(len(bodies))))
    assert len(ran_in) >= 10 and set(ran_in) == {"tiergate-cache-write"}, ran_in[:5]
    assert wal_size(path) < WAL_BOUND, wal_size(path)

    # hits alone: each writes an LRU mark; the checkpoints they make due still run in the writer thread
    ran_in.clear()
    cache.recent.clear()  # every hit goes to the store (and touches its entry there)
    for i in range(len(bodies)):
        hit = await cache.alookup(scopes[i % 3], bodies[i])
        assert isinstance(hit, Hit)
    await asyncio.to_thread(cache.writes.close)  # what the lookups queued has run
    # (how many depends on how the marks fall between writes: 3 in one loaded run, ~15 alone; at least one)
    assert ran_in and set(ran_in) == {"tiergate-cache-write"}, ran_in[:5]
    assert wal_size(path) < WAL_BOUND, wal_size(path)
    cache.close()
    assert not os.path.exists(f"{path}-wal") or wal_size(path) == 0  # the last connection closed: folded in
