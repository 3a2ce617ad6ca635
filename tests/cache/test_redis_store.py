"""Replicas sharing one real redis-server: a write on one is servable by another, deletes follow too."""

from __future__ import annotations

from cache import Embedder, Hit, RedisStore, SemanticCache, TenantPolicy
from tests.cache.conftest import FakeClock, chat, scope

Q = "How do I convert 5 km to miles?"
PARAPHRASE = "How can I convert 5 kilometers into miles?"


def _replica(url: str, embedder: Embedder, clock: FakeClock, **kwargs: object) -> SemanticCache:
    return SemanticCache(RedisStore(url, max_entries=kwargs.pop("max_entries", 100)), embedder, clock=clock,
                         sync_interval_s=kwargs.pop("sync_interval_s", 0.0), **kwargs)


def test_a_write_on_one_replica_is_served_by_another(redis_url: str, embedder: Embedder, clock: FakeClock) -> None:
    a, b = _replica(redis_url, embedder, clock), _replica(redis_url, embedder, clock)
    body = chat(Q)
    a.store(scope(body), body, "3.1 miles", {"total_tokens": 12})
    exact = b.lookup(scope(body), body)
    assert isinstance(exact, Hit) and exact.kind == "exact" and exact.usage == {"total_tokens": 12}
    b.sync()  # what b's writer thread does once a lookup finds a catch-up due (a lookup only queues it)
    para = b.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))  # needs b's faiss index to have followed a
    assert isinstance(para, Hit) and para.kind == "semantic" and para.response == "3.1 miles"
    near = chat("How do I convert 7 km to miles?")
    assert b.lookup(scope(near), near).status == "miss"
    assert a.purge("acme") == 1
    assert b.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE)).status == "miss"  # the store is the truth
    b.sync()
    assert len(b.index) == 0  # the delete reached b's index through the change log
    a.close()
    b.close()


def test_a_new_replica_loads_existing_entries(redis_url: str, embedder: Embedder, clock: FakeClock) -> None:
    a = _replica(redis_url, embedder, clock)
    a.store(scope(chat(Q)), chat(Q), "3.1 miles")
    late = _replica(redis_url, embedder, clock)
    assert len(late.index) == 1
    assert late.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE)).status == "hit"
    assert late.lookup(scope(chat(Q), tenant="globex"), chat(Q)).status == "miss"


def test_the_size_bound_holds_across_replicas(redis_url: str, embedder: Embedder, clock: FakeClock) -> None:
    a = _replica(redis_url, embedder, clock, max_entries=2)
    b = _replica(redis_url, embedder, clock, max_entries=2)
    questions = ["What is the capital of France?", "What is the boiling point of water?", "Who wrote Hamlet?"]
    for i, (replica, q) in enumerate(zip((a, b, a), questions, strict=True)):
        clock.now += 1
        replica.store(scope(chat(q)), chat(q), f"a{i}")
    assert len(a.entries) == 2
    b.sync()
    a.sync()
    assert len(a.index) == len(b.index) == 2
    assert b.lookup(scope(chat(questions[0])), chat(questions[0])).status == "miss"  # the oldest went


def test_ttl_in_redis(redis_url: str, embedder: Embedder, clock: FakeClock) -> None:
    a = _replica(redis_url, embedder, clock)
    a.store(scope(chat(Q)), chat(Q), "x", policy=TenantPolicy(ttl_s=10))
    clock.now += 11
    assert a.lookup(scope(chat(Q)), chat(Q)).status == "miss"
    assert len(a.entries) == 0 and len(a.index) == 0


def _replicas_after_a_write(url: str, embedder: Embedder, clock: FakeClock,
                            **kwargs: object) -> tuple[SemanticCache, SemanticCache]:
    """Two replicas, made once the log holds an event (where a replica's cursor then stands)."""
    a = _replica(url, embedder, clock)
    first = chat("What is the tallest mountain?")
    a.store(scope(first, tenant="initech"), first, "Everest")
    return a, _replica(url, embedder, clock, **kwargs)


def _trim_log(replica: SemanticCache) -> None:
    """Cut the change log to its last event, as Redis's MAXLEN trimming does to a replica far behind."""
    store = replica.entries
    assert isinstance(store, RedisStore)
    store.redis.xtrim(store.prefix + "log", maxlen=1, approximate=False)


def test_a_replica_behind_a_trimmed_log_reloads_its_index(redis_url: str, embedder: Embedder,
                                                          clock: FakeClock) -> None:
    a, b = _replicas_after_a_write(redis_url, embedder, clock)
    for q in (Q, "Who wrote Hamlet?", "What is the boiling point of water?"):
        a.store(scope(chat(q)), chat(q), f"answer to {q}")
    _trim_log(a)  # b never read the first two writes' events
    b.sync()
    assert len(b.index) == 4
    para = b.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))
    assert isinstance(para, Hit) and para.kind == "semantic"
    a.close()
    b.close()


def test_a_deletion_cut_from_the_log_is_not_served_from_a_replicas_memory(redis_url: str, embedder: Embedder,
                                                                        clock: FakeClock) -> None:
    # b syncs by hand here, and serves exact hits from its map of recent entries while its last sync is recent
    a, b = _replicas_after_a_write(redis_url, embedder, clock, sync_interval_s=60.0)
    body = chat(Q)
    a.store(scope(body), body, "3.1 miles")
    assert b.lookup(scope(body), body).status == "hit"  # b keeps it in its map of recent entries
    assert a.purge("acme") == 1
    other = chat("Who wrote Hamlet?")
    a.store(scope(other, tenant="globex"), other, "Shakespeare")
    _trim_log(a)  # the purge's event is gone before b read it
    b.sync()
    assert b.lookup(scope(body), body).status == "miss"
    a.close()
    b.close()


def test_a_bump_on_one_replica_stops_another_replicas_late_write_of_old_data(
        redis_url: str, embedder: Embedder, clock: FakeClock) -> None:
    a, b = _replica(redis_url, embedder, clock), _replica(redis_url, embedder, clock)
    body = chat(Q)
    old = scope(body, data_version=1)
    late = b.remember(old, body, "answer from the old data")  # b is still writing it when a bumps the version
    assert late is not None
    clock.now += 1
    a.bump_data_version("acme", 2)
    assert b.persist(late) is None
    assert len(a.entries) == 0 and b.lookup(old, body).status == "miss"
    a.close()
    b.close()
