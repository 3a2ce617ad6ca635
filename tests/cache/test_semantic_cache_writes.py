"""One tenant's writes never stall another tenant's lookups on the event loop, and racing writes and lookups keep
read-your-own-writes and tenant isolation.

`apersist` hands its write to a worker thread. Writes take the cache's lock and the store's one write connection,
so a flood of them queues; if they queued in the threads every lookup's steps run in (the loop's default
executor), every tenant's lookups waited behind them."""

from __future__ import annotations

import asyncio
import random
import threading

from bench.cache_write_contention import HashEmbedder
from cache.request_key import embedding_text
from cache.results import Hit, Miss
from cache.semantic_cache import SemanticCache
from cache.sqlite_store import SQLiteStore
from tests.cache.conftest import chat, scope

WAIT_S = 10.0  # the longest a lookup may take while another tenant's writes are held
FLOOD = 40  # more writes than the default executor has threads (min(32, cores + 4))


async def test_lookups_return_while_another_tenants_writes_are_held(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = SQLiteStore(tmp_path / "cache.db", max_entries=1000)
    cache = SemanticCache(store, HashEmbedder())
    b_body = chat("What is the boiling point of water?")
    b_scope = scope(b_body, tenant="tenant-b")
    assert cache.store(b_scope, b_body, "100 C") is not None
    a_scope = scope(chat("q"), tenant="tenant-a")

    held, release = threading.Event(), threading.Event()
    put = store.put

    def held_put(entry):  # type: ignore[no-untyped-def]
        if entry.tenant == "tenant-a":
            held.set()
            assert release.wait(120), "the test never released A's writes"
        return put(entry)

    store.put = held_put  # type: ignore[method-assign]
    a_bodies = [chat(f"question {i} of tenant a") for i in range(FLOOD)]
    writes = [asyncio.create_task(cache.astore(a_scope, body, f"answer {i}")) for i, body in enumerate(a_bodies)]
    try:
        assert await asyncio.to_thread(held.wait, WAIT_S), "A's first write never reached the store"
        await asyncio.sleep(0.05)  # let every other write of A's reach a worker thread, if it is going to

        hit = await asyncio.wait_for(cache.alookup(b_scope, b_body), WAIT_S)
        assert isinstance(hit, Hit) and hit.response == "100 C"
        miss = await asyncio.wait_for(cache.alookup(b_scope, chat("Who wrote Hamlet?")), WAIT_S)
        assert isinstance(miss, Miss)
        # A's answers, not yet written, are this process's exact hits already (read your own writes)...
        for i, body in enumerate(a_bodies):
            found = await asyncio.wait_for(cache.alookup(a_scope, body), WAIT_S)
            assert isinstance(found, Hit) and found.response == f"answer {i}"
            # ... and never B's
            assert not isinstance(await asyncio.wait_for(cache.alookup(b_scope, body), WAIT_S), Hit)
    finally:
        release.set()
    stored = await asyncio.wait_for(asyncio.gather(*writes), 60)
    assert all(e is not None for e in stored)
    for i, body in enumerate(a_bodies):  # written: hits from the store too, not only from memory
        found = cache.lookup(a_scope, body)
        assert isinstance(found, Hit) and found.response == f"answer {i}"
    cache.close()


async def test_racing_writes_lookups_and_purges_keep_own_writes_and_isolation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tenants store, look up and purge at random on one loop while threads store too. Each write, once it
    returns, is an exact hit of its own tenant with its own answer (unless that tenant purged after it); no lookup
    ever returns another tenant's entry."""
    store = SQLiteStore(tmp_path / "cache.db", max_entries=10_000)
    cache = SemanticCache(store, HashEmbedder(), hnsw_from=16)  # HNSW switches (rebuilds) while it runs
    tenants = [f"tenant-{t}" for t in "abcd"]
    scopes = {t: scope(chat("q"), tenant=t) for t in tenants}
    # purges of each tenant started and finished: a write is checked only if none ran while it was written and read
    # back (a purge racing a write may take it, as it should)
    started, done = dict.fromkeys(tenants, 0), dict.fromkeys(tenants, 0)

    def purges(tenant: str) -> tuple[int, int]:
        return started[tenant], done[tenant]

    def unpurged(tenant: str, before: tuple[int, int]) -> bool:
        return before[0] == before[1] == started[tenant]
    rng = random.Random(7)
    failures: list[str] = []

    def check(tenant: str, result: object) -> None:
        if isinstance(result, Hit) and result.entry.tenant != tenant:
            failures.append(f"{tenant} was served {result.entry.tenant}'s entry {result.entry.entry_id}")

    async def actor(tenant: str, n: int, seed: int) -> None:  # seed: unique per actor
        r = random.Random(seed)
        sc = scopes[tenant]
        for i in range(n):
            op = r.random()
            if op < 0.55:
                # every tenant asks the same questions: only the scope keeps their answers apart
                body = chat(f"shared question {r.randrange(200)} {i} {seed}")  # no other actor stores it
                answer = f"{tenant} answer {i}"
                before = purges(tenant)
                entry = await cache.astore(sc, body, answer)
                found = await cache.alookup(sc, body)
                check(tenant, found)
                if entry is not None and unpurged(tenant, before) and not (
                        isinstance(found, Hit) and found.kind == "exact" and found.response == answer):
                    failures.append(f"{tenant} did not read its own write {answer!r}: {found!r}")
                other = tenants[(tenants.index(tenant) + 1) % len(tenants)]
                check(other, await cache.alookup(scopes[other], body))
            elif op < 0.97:
                check(tenant, await cache.alookup(sc, chat(f"shared question {r.randrange(200)} {i}")))
            else:
                started[tenant] += 1
                await asyncio.to_thread(cache.purge, tenant)
                done[tenant] += 1
            if r.random() < 0.2:
                await asyncio.sleep(0)

    def thread_writer(tenant: str, n: int) -> None:
        sc = scopes[tenant]
        for i in range(n):
            body = chat(f"thread question {i}")  # each tenant's thread its own scope: no other writer of it
            before = purges(tenant)
            entry = cache.store(sc, body, f"{tenant} thread {i}")
            found = cache.lookup(sc, body)
            check(tenant, found)
            if entry is not None and unpurged(tenant, before) and not (
                    isinstance(found, Hit) and found.response == f"{tenant} thread {i}"):
                failures.append(f"{tenant}'s thread did not read its own write {i}: {found!r}")
            check("tenant-a" if tenant != "tenant-a" else "tenant-b",
                  cache.lookup(scopes["tenant-a" if tenant != "tenant-a" else "tenant-b"], body))

    threads = [threading.Thread(target=thread_writer, args=(t, 80), daemon=True) for t in tenants[:2]]
    for t in threads:
        t.start()
    await asyncio.wait_for(asyncio.gather(*(actor(t, 120, rng.randrange(1 << 30)) for t in tenants for _ in range(3))),
                           120)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not failures, failures[:5]
    assert cache.index.idle(WAIT_S)
    for t in tenants:  # what is left in each tenant's partitions is its own
        for entry_id in store.ids_of_tenant(t):
            entry = store.get(entry_id)
            assert entry is not None and entry.tenant == t
    cache.close()


def _embedded(cache: SemanticCache, sc, body, answer: str):  # type: ignore[no-untyped-def]
    """A remembered answer whose vector is already there, so `apersist` queues its write at once, in call order."""
    entry = cache.remember(sc, body, answer)
    assert entry is not None
    entry.embedding = cache.vectors.get(embedding_text(entry.semantic_text), owner=entry.tenant)
    return entry


async def test_a_tenants_write_waits_for_a_few_of_another_tenants_flood_not_all(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The writer holds A's first write; A queues 100 more, then B one. Released, B's write is among the first few
    to reach the store (the writer takes the tenants in turns), not behind A's whole flood."""
    store = SQLiteStore(tmp_path / "cache.db", max_entries=1000)
    cache = SemanticCache(store, HashEmbedder())
    a_scope, b_scope = scope(chat("q"), tenant="tenant-a"), scope(chat("q"), tenant="tenant-b")
    held, release = threading.Event(), threading.Event()
    order: list[str] = []
    put = store.put

    def held_put(entry):  # type: ignore[no-untyped-def]
        order.append(entry.tenant)
        if len(order) == 1:
            held.set()
            assert release.wait(120), "the test never released the writer"
        return put(entry)

    store.put = held_put  # type: ignore[method-assign]
    a_entries = [_embedded(cache, a_scope, chat(f"question {i} of tenant a"), f"answer {i}") for i in range(101)]
    b_body = chat("What is the boiling point of water?")
    b_entry = _embedded(cache, b_scope, b_body, "100 C")
    writes = [asyncio.create_task(cache.apersist(e)) for e in a_entries]
    try:
        assert await asyncio.to_thread(held.wait, WAIT_S), "A's first write never reached the store"
        b_write = asyncio.create_task(cache.apersist(b_entry))
        for _ in range(3):
            await asyncio.sleep(0)  # B's write queued behind A's 100
        hit = await asyncio.wait_for(cache.alookup(b_scope, b_body), WAIT_S)  # B reads its own write meanwhile
        assert isinstance(hit, Hit) and hit.response == "100 C"
    finally:
        release.set()
    assert await asyncio.wait_for(b_write, 60) is not None
    await asyncio.wait_for(asyncio.gather(*writes), 60)
    assert order.index("tenant-b") <= 2, f"B's write was write {order.index('tenant-b') + 1}, behind A's flood"
    hit = await cache.alookup(b_scope, b_body)  # from the store now
    assert isinstance(hit, Hit) and hit.response == "100 C"
    cache.close()


async def test_a_tenants_full_write_queue_drops_its_oldest_write_and_keeps_its_newest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Past `writes_queued_per_tenant`, a tenant's oldest queued write is dropped (counted, its apersist None), never
    another tenant's; the newest answers are still read back at once, while held and once written."""
    store = SQLiteStore(tmp_path / "cache.db", max_entries=1000)
    cache = SemanticCache(store, HashEmbedder(), writes_queued_per_tenant=8)
    a_scope, b_scope = scope(chat("q"), tenant="tenant-a"), scope(chat("q"), tenant="tenant-b")
    held, release = threading.Event(), threading.Event()
    put = store.put

    def held_put(entry):  # type: ignore[no-untyped-def]
        held.set()
        assert release.wait(120), "the test never released the writer"
        return put(entry)

    store.put = held_put  # type: ignore[method-assign]
    a_bodies = [chat(f"question {i} of tenant a") for i in range(21)]
    a_entries = [_embedded(cache, a_scope, body, f"answer {i}") for i, body in enumerate(a_bodies)]
    b_bodies = [chat(f"question {i} of tenant b") for i in range(3)]
    b_entries = [_embedded(cache, b_scope, body, f"b answer {i}") for i, body in enumerate(b_bodies)]
    writes = [asyncio.create_task(cache.apersist(a_entries[0]))]
    try:
        assert await asyncio.to_thread(held.wait, WAIT_S), "A's first write never reached the store"
        writes += [asyncio.create_task(cache.apersist(e)) for e in a_entries[1:] + b_entries]
        for _ in range(3):
            await asyncio.sleep(0)
        # 1 being written, 8 queued: A's 2nd to 12th were dropped, oldest first
        assert cache.stats.dropped_writes == {"tenant-a": 12}
        for i, body in enumerate(a_bodies):  # what is still to be written is read back at once
            found = await cache.alookup(a_scope, body)
            assert isinstance(found, Hit) == (i == 0 or i > 12), (i, found)
        for i, body in enumerate(b_bodies):
            found = await cache.alookup(b_scope, body)
            assert isinstance(found, Hit) and found.response == f"b answer {i}"
    finally:
        release.set()
    results = await asyncio.wait_for(asyncio.gather(*writes), 60)
    assert [r is not None for r in results] == [True] + [False] * 12 + [True] * 8 + [True] * 3
    for i, body in enumerate(a_bodies):
        found = await cache.alookup(a_scope, body)
        assert isinstance(found, Hit) == (i == 0 or i > 12), (i, found)
    assert len(store) == 1 + 8 + 3 and cache.stats.stored == 12
    cache.close()
