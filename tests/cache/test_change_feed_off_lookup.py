"""Other workers' writes reach this worker's index off its lookups' path, reading only what the index needs.

A lookup that found the change log due caught up in its own call, in its tenant's thread: after a flooding tenant
stored 2,000 entries on another worker, a victim's next lookup applied all of them (94 ms against 0.45 ms), and
each put read the whole entry, its answer included, one read at a time. Now the lookup only queues the catch-up for
the cache's writer thread (cache/entry_writes.py `sync_soon`), and the catch-up reads partitions and vectors in
batches (`vectors_of`). Both stores, SQLite (a shared file) and Redis (a real redis-server)."""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache import RedisStore, SemanticCache, SQLiteStore
from cache.store import CacheStore
from tests.cache.conftest import chat, scope

WRITES = 200
WRITER_THREAD = "tiergate-cache-write"


class HashEmbedder:
    """A vector per text from its hash: no model, so 200 writes take a moment."""

    dim = 8
    max_tokens = 256

    def num_tokens(self, text: str) -> int:
        return len(text) // 4

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        out = []
        for text in texts:
            v = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.uint8).astype(np.float32) + 1
            out.append(v / np.linalg.norm(v))
        return np.stack(out) if out else np.zeros((0, self.dim), np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode([text])[0]


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], CacheStore]:
    if request.param == "sqlite":
        return lambda: SQLiteStore(tmp_path / "cache.sqlite3", max_entries=10_000)
    url = request.getfixturevalue("redis_url")
    return lambda: RedisStore(url, max_entries=10_000)


@pytest.fixture
def workers(open_store: Callable[[], CacheStore]) -> Iterator[tuple[SemanticCache, SemanticCache]]:
    """Two workers on one store: the flooder's and the victim's (made before the flood: its cursor is behind it)."""
    made = [SemanticCache(open_store(), HashEmbedder(), sync_interval_s=60.0) for _ in range(2)]  # type: ignore[arg-type]
    yield made[0], made[1]
    for cache in made:
        cache.close()


def _flood(writer: SemanticCache, n: int = WRITES) -> None:
    for i in range(n):
        body = chat(f"flood question number {i}")
        writer.store(scope(body, tenant="flooder"), body, f"answer {i} " + "x" * 2000)


def test_a_lookup_after_another_workers_writes_does_not_catch_up_itself(
        workers: tuple[SemanticCache, SemanticCache]) -> None:
    writer, victim = workers
    _flood(writer)
    victim.feed._tried = -math.inf  # its catch-up is due: the next lookup finds it so
    store = victim.entries
    reads: list[str] = []  # the thread of each read of the change log
    changes_since = store.changes_since

    def spy(cursor: str, limit: int = 1000) -> tuple[str, list[tuple[str, str, str]]]:
        reads.append(threading.current_thread().name)
        return changes_since(cursor, limit)

    store.changes_since = spy  # type: ignore[method-assign]
    applied: list[tuple[str, int]] = []  # (thread, changes) of each page applied
    apply = victim.writes.apply

    def applying(changes: Any) -> None:
        applied.append((threading.current_thread().name, len(changes) if isinstance(changes, list) else 1))
        apply(changes)

    victim.writes.apply = applying  # type: ignore[method-assign]
    body = chat("what is the weather in Oslo")
    me = threading.current_thread().name
    assert victim.lookup(scope(body, tenant="victim"), body).status == "miss"
    assert me not in reads and me not in [thread for thread, _ in applied]  # the lookup caught up in its own call
    assert victim.writes.last_sync is not None
    assert victim.writes.last_sync.result(timeout=30) == WRITES  # queued: the writer thread caught up
    assert set(reads) == {WRITER_THREAD} and {thread for thread, _ in applied} == {WRITER_THREAD}
    assert sum(n for _, n in applied) == WRITES and len(victim.index) == WRITES
    flooded = chat("flood question number 7")
    hit = victim.lookup(scope(flooded, tenant="flooder"), flooded)
    assert hit.status == "hit" and hit.response.startswith("answer 7 ")  # type: ignore[union-attr]


def _spy_reads(store: CacheStore) -> dict[str, list[Any]]:
    """What the store is asked for: whole entries (`get`), SQL statements, Redis pipelines' commands."""
    seen: dict[str, list[Any]] = {"get": [], "sql": [], "pipelines": [], "hgetall": []}
    get = store.get
    store.get = lambda entry_id: seen["get"].append(entry_id) or get(entry_id)  # type: ignore[method-assign]
    if isinstance(store, SQLiteStore):
        read = store._read
        store._read = lambda sql, args=(): seen["sql"].append(sql) or read(sql, args)  # type: ignore[method-assign]
    else:
        assert isinstance(store, RedisStore)
        client = store.redis
        pipeline, hgetall = client.pipeline, client.hgetall

        def spied_pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            def spied_execute(*a: Any, **k: Any) -> Any:
                seen["pipelines"].append([command[0] for command in pipe.command_stack])
                return execute(*a, **k)

            pipe.execute = spied_execute
            return pipe

        client.pipeline = spied_pipeline  # type: ignore[method-assign]
        client.hgetall = lambda *a, **k: seen["hgetall"].append(a) or hgetall(*a, **k)  # type: ignore[method-assign]
    return seen


def test_the_catch_up_reads_vectors_in_batches_and_no_answers(workers: tuple[SemanticCache, SemanticCache]) -> None:
    writer, victim = workers
    _flood(writer)
    seen = _spy_reads(victim.entries)
    assert victim.sync() == WRITES
    assert len(victim.index) == WRITES
    assert seen["get"] == [] and seen["hgetall"] == []  # no entry read whole (each put read one: 200 reads)
    if isinstance(victim.entries, SQLiteStore):
        entries = [sql for sql in seen["sql"] if "FROM entries" in sql]
        assert len(entries) == 1  # one SELECT for the 200 ids
        assert "response" not in entries[0] and "semantic_text" not in entries[0]
        assert entries[0].startswith("SELECT entry_id, partition, embedding FROM entries WHERE entry_id IN (")
    else:
        assert len(seen["pipelines"]) == 1  # one round trip for the 200 ids
        assert len(seen["pipelines"][0]) == WRITES
        assert all(c[0] == "HMGET" and c[2:] == ("partition", "embedding") for c in seen["pipelines"][0])


def test_a_put_then_its_deletion_in_one_page_leaves_nothing(workers: tuple[SemanticCache, SemanticCache]) -> None:
    writer, victim = workers
    _flood(writer, 5)
    assert writer.purge("flooder") == 5
    body = chat("kept question")
    writer.store(scope(body), body, "kept")
    assert victim.sync() == 11  # 5 puts, 5 deletions, 1 put
    assert len(victim.index) == 1
    assert victim.lookup(scope(body), body).status == "hit"


PAGE, PAGES_PER_JOB = 10, 2  # a small log page and step, so a backlog of a few steps takes 60 writes


def _hold_writer_thread(cache: SemanticCache) -> threading.Event:
    """Hold the cache's writer thread in a job of its own until the event returned is set."""
    gate, holding = threading.Event(), threading.Event()
    cache.writes._queue.submit("holder", lambda: holding.set() or gate.wait(30))
    assert holding.wait(30)
    return gate


def test_a_long_backlog_is_caught_up_a_step_a_job_with_tenants_writes_between(
        workers: tuple[SemanticCache, SemanticCache]) -> None:
    """One job applied the whole backlog (a reload of the index, or another worker's flood): every tenant's writes
    queued behind it, the oldest past the per-tenant bound dropped. Now a job applies `pages_per_job` pages and
    queues the next step behind the writes queued meanwhile."""
    writer, victim = workers
    _flood(writer, 3 * PAGES_PER_JOB * PAGE)
    victim.feed.page, victim.feed.pages_per_job = PAGE, PAGES_PER_JOB
    order: list[tuple[str, str]] = []  # (page or write, thread) of the writer thread's work, in order
    apply, write = victim.writes.apply, victim.writes.write

    def applying(changes: Any) -> None:
        order.append(("page", threading.current_thread().name))
        apply(changes)

    def writing(entry: Any) -> Any:
        order.append(("write", threading.current_thread().name))
        return write(entry)

    victim.writes.apply = applying  # type: ignore[method-assign]
    victim.writes.write = writing  # type: ignore[method-assign]
    gate = _hold_writer_thread(victim)
    victim.feed._tried = -math.inf  # its catch-up is due: the next lookup queues it
    asked = chat("what is the weather in Oslo")
    assert victim.lookup(scope(asked, tenant="victim"), asked).status == "miss"
    written = []
    for i in range(3):  # the victim's own answers, queued behind the catch-up
        body = chat(f"victim question {i}")
        entry = victim.remember(scope(body, tenant="victim"), body, f"victim answer {i}")
        assert entry is not None
        written.append(victim.writes.submit(entry))
    gate.set()
    assert victim.writes.last_sync is not None
    assert victim.writes.last_sync.result(timeout=30) >= 3 * PAGES_PER_JOB * PAGE
    assert all(w.result(timeout=30) is not None for w in written)
    assert {thread for _, thread in order} == {WRITER_THREAD}
    steps = "".join("P" if kind == "page" else "W" for kind, _ in order)
    assert steps.startswith("PPWPPWPPW")  # was PWWW: all 60 changes in one page, one job, the writes after it
    assert len(victim.index) == 3 * PAGES_PER_JOB * PAGE  # every flooded entry (the victim's are exact-only)
    flooded = chat("flood question number 57")
    assert victim.lookup(scope(flooded, tenant="flooder"), flooded).status == "hit"


def test_an_explicit_sync_applies_every_page_before_it_returns(workers: tuple[SemanticCache, SemanticCache]) -> None:
    writer, victim = workers
    _flood(writer, 3 * PAGES_PER_JOB * PAGE + 5)
    victim.feed.page, victim.feed.pages_per_job = PAGE, PAGES_PER_JOB
    assert victim.sync() == 3 * PAGES_PER_JOB * PAGE + 5
    assert len(victim.index) == 3 * PAGES_PER_JOB * PAGE + 5 and victim.feed.recent()


def test_a_cancelled_catch_up_lets_a_later_lookup_queue_another(workers: tuple[SemanticCache, SemanticCache]) -> None:
    """A queued catch-up whose future was cancelled was skipped by the writer thread and left its flag set: no
    lookup queued a catch-up again, and this worker never saw another's writes."""
    writer, victim = workers
    gate = _hold_writer_thread(victim)
    victim.feed._tried = -math.inf
    body = chat("what is the weather in Oslo")
    victim.lookup(scope(body, tenant="victim"), body)
    cancelled = victim.writes.last_sync
    assert cancelled is not None and cancelled.cancel()
    gate.set()
    victim.writes._queue.submit("after", lambda: None).result(timeout=30)  # the writer thread is past it
    _flood(writer, 5)
    victim.feed._tried = -math.inf
    victim.lookup(scope(body, tenant="victim"), body)
    queued = victim.writes.last_sync
    assert queued is not cancelled  # none was queued: the cancelled one's flag was still set
    assert queued is not None and queued.result(timeout=30) == 5
    assert len(victim.index) == 5
