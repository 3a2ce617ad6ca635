"""The facade with the real MiniLM embedder, what becomes of stored entries: TTL (a lowered one too), LRU eviction,
data-version bumps, retired model versions, purges, a restart, and caches sharing one file."""

from __future__ import annotations

from pathlib import Path

from cache import Embedder, Hit, SemanticCache, SQLiteStore, TenantPolicy
from tests.cache.conftest import FakeClock, chat, scope

Q = "How do I convert 5 km to miles?"
PARAPHRASE = "How can I convert 5 kilometers into miles?"


def _stored(cache: SemanticCache, body: dict | None = None, **scope_args: object) -> None:
    body = body or chat(Q)
    assert cache.store(scope(body, **scope_args), body, "3.1 miles", {"total_tokens": 12}) is not None


def test_ttl_expires_entries(cache: SemanticCache, clock: FakeClock) -> None:
    body = chat(Q)
    cache.store(scope(body), body, "a", policy=TenantPolicy(ttl_s=60))
    clock.now += 59
    assert cache.lookup(scope(body), body).status == "hit"
    clock.now += 2
    assert cache.lookup(scope(body), body).status == "miss"
    assert cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE)).status == "miss"
    assert len(cache.entries) == 0  # the expired entry was deleted on sight


def test_lru_eviction_keeps_recently_used(embedder: Embedder, clock: FakeClock) -> None:
    cache = SemanticCache(SQLiteStore(max_entries=2), embedder, clock=clock)
    questions = ["What is the capital of France?", "What is the boiling point of water?", "Who wrote Hamlet?"]
    for i, q in enumerate(questions[:2]):
        clock.now += 1
        cache.store(scope(chat(q)), chat(q), f"a{i}")
    clock.now += 1
    assert cache.lookup(scope(chat(questions[0])), chat(questions[0])).status == "hit"  # now most recent
    clock.now += 1
    cache.store(scope(chat(questions[2])), chat(questions[2]), "a2")
    assert cache.lookup(scope(chat(questions[1])), chat(questions[1])).status == "miss"  # evicted
    assert len(cache.index) == 2  # the evicted vector left the index too
    for q in (questions[0], questions[2]):
        assert cache.lookup(scope(chat(q)), chat(q)).status == "hit"


def test_bump_deletes_the_old_versions_entries(cache: SemanticCache, clock: FakeClock) -> None:
    _stored(cache, data_version=1)
    _stored(cache, chat("Who wrote Hamlet?"), tenant="globex")
    clock.now += 1
    assert cache.bump_data_version("acme", 2) == 1  # deleted now, not left until their TTL
    assert cache.lookup(scope(chat(Q), data_version=2), chat(Q)).status == "miss"
    assert len(cache.entries) == 1 and len(cache.index) == 1  # globex untouched
    _stored(cache, data_version=2)
    _stored(cache, chat("Who wrote Hamlet?"), data_version="2:pinned-by-header")  # stored after the bump: kept
    cache.reclaim()
    assert cache.lookup(scope(chat(Q), data_version=2), chat(Q)).status == "hit"
    hamlet = chat("Who wrote Hamlet?")
    assert cache.lookup(scope(hamlet, data_version="2:pinned-by-header"), hamlet).status == "hit"


def test_retired_model_version_is_deleted(cache: SemanticCache) -> None:
    _stored(cache, model_version="m1")
    _stored(cache, model_version="m2")
    assert cache.retire_model_version("m1") == 1  # now, not at a later write's reclaim
    assert cache.reclaim() == 0 and len(cache.entries) == 1
    assert cache.lookup(scope(chat(Q), model_version="m2"), chat(Q)).status == "hit"


def test_purge_by_tenant_and_all(cache: SemanticCache) -> None:
    _stored(cache)
    _stored(cache, tenant="globex")
    assert cache.purge("acme") == 1
    assert cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE)).status == "miss"
    assert cache.lookup(scope(chat(Q), tenant="globex"), chat(Q)).status == "hit"
    assert cache.purge() == 1 and len(cache.entries) == 0 and len(cache.index) == 0


def test_entries_and_semantic_hits_survive_restart(tmp_path: Path, embedder: Embedder) -> None:
    path = tmp_path / "cache.sqlite3"
    first = SemanticCache(SQLiteStore(path), embedder)
    _stored(first)
    first.close()
    second = SemanticCache(SQLiteStore(path), embedder)
    assert second.lookup(scope(chat(Q)), chat(Q)).status == "hit"
    para = second.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))
    assert isinstance(para, Hit) and para.kind == "semantic"
    second.close()


def test_caches_sharing_a_file_follow_each_others_writes_and_deletes(tmp_path: Path, embedder: Embedder,
                                                                     clock: FakeClock) -> None:
    path = tmp_path / "cache.sqlite3"
    a = SemanticCache(SQLiteStore(path), embedder, clock=clock, sync_interval_s=0.0)
    b = SemanticCache(SQLiteStore(path), embedder, clock=clock, sync_interval_s=0.0)
    _stored(a)
    b.sync()  # what b's writer thread does once a lookup finds a catch-up due (a lookup only queues it)
    para = b.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))
    assert isinstance(para, Hit) and para.kind == "semantic"  # b's index followed a's write
    clock.now += 1
    cli = SQLiteStore(path)  # `tiergate tenants bump-data-version` opens the same file
    assert len(cli.drop_data_versions("acme", "2", clock.now)) == 1
    assert b.lookup(scope(chat(Q)), chat(Q)).status == "miss"  # the store is the truth, before any catch-up
    b.sync()
    assert len(b.index) == 0  # the CLI's delete reached b's index through the change log
    for c in (a, b, cli):
        c.close()


def test_a_lowered_ttl_serves_nothing_older_than_itself(cache: SemanticCache, clock: FakeClock) -> None:
    """A plan's TTL lowered (or set where it had none) after entries were stored under the old one: those older
    than the new TTL are not served, exact or semantic, from the store or this process's memory."""
    body = chat(Q)
    cache.store(scope(body), body, "a", policy=TenantPolicy(ttl_s=None))
    assert cache.lookup(scope(body), body).status == "hit"  # now in the map of recent entries too
    clock.now += 120
    lowered = TenantPolicy(ttl_s=60)
    assert cache.lookup(scope(body), body, policy=lowered).status == "miss"
    assert cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=lowered).status == "miss"
    assert cache.lookup(scope(body), body, policy=TenantPolicy(ttl_s=3600)).status == "hit"  # changed back
    fresh = cache.remember(scope(body), body, "b", policy=lowered)  # a new answer, pending: within the TTL
    assert fresh is not None
    assert cache.lookup(scope(body), body, policy=lowered).response == "b"
