"""A key id the tenant store has not cached is looked up off the event loop (PostgreSQL: a network round trip).

Anyone can send `Authorization: Bearer tg-<made-up id>-…`, a new id each time; with the fleet database each was a
synchronous query on the gateway's event loop, so a flood of them stalled every tenant's requests. Here the
database's answers are held (each query waits on the calling thread, as for a remote database's round trip, until
the test lets it answer) and the gateway's authentication (gateway/auth.py, as the routes call it) is flooded with
made-up keys: while every query waits, the loop goes on, a cached tenant is answered and the lookups past the
bound on lookups at once get their 503; once answered, made-up keys get 401, real keys still authenticate, and
concurrent lookups of one id share one query. What is checked is what happens before the database answers, never
how long anything took (a loaded machine makes any bound on that a flake).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.auth import provide_principal, provide_tenant
from gateway.errors import Unauthenticated, Unavailable
from gateway.tenants.keys import parse_key
from gateway.tenants.store import TenantStore
from gateway.tenants.store_postgres import LOOKUP_THREADS, MAX_LOOKUPS, PostgresTenantStore
from tests.gateway.tenants.held_reads import hold_first

FLOOD = 200  # made-up keys sent at once: on the event loop, 200 round trips = a second of nobody served
GUARD_S = 10.0  # a bound on waiting for what must happen, never reached when it works: a failure, not a hang


def request(key: str) -> Any:
    """What gateway/auth.py reads of a request: its headers (and as the ASGI scope has them: a repeated key header
    is refused), and its state (where the key id goes)."""
    return SimpleNamespace(headers={"authorization": f"Bearer {key}"}, state=SimpleNamespace(),
                           scope={"headers": [(b"authorization", f"Bearer {key}".encode())]})


def made_up_key() -> str:
    return f"tg-{secrets.token_hex(6)}-{secrets.token_urlsafe(32)}"


@dataclass
class Database:
    """A PostgreSQL store with tenant acme's `key` cached, whose queries wait while `answering` is clear."""

    store: PostgresTenantStore
    key: str
    queries: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)  # each query as it begins
    answering: threading.Event = field(default_factory=threading.Event)  # set: queries answer; clear: they wait
    gave_up: bool = False  # a query waited GUARD_S and answered anyway: something held the test up


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    store = PostgresTenantStore(database_url)
    store.create_tenant("acme", "standard")
    _, key = store.issue_key("acme")
    database = Database(store, key)
    database.answering.set()
    real = store._fetchone

    def held(sql: str, args: tuple[Any, ...] = ()) -> Any:
        database.queries.append((sql, args))
        if not database.answering.wait(GUARD_S):
            database.gave_up = True
            database.answering.set()  # the queries after it answer at once: the test fails rather than hangs
        return real(sql, args)

    store._fetchone = held  # type: ignore[method-assign]
    deadline = time.monotonic() + GUARD_S  # cached, once the listener follows the changes: no query asked
    while database.queries or store.authenticate(key) is None or database.queries:
        assert time.monotonic() < deadline, f"the key was not cached within {GUARD_S} s"
        database.queries.clear()
        time.sleep(0.01)
    yield database
    database.answering.set()
    store.close()


async def until(done: Callable[[], bool], what: str) -> None:
    """Wait on the loop (other tasks run meanwhile) until `done()`, GUARD_S at most: a failure, not a hang."""
    deadline = time.monotonic() + GUARD_S
    while not done():
        assert time.monotonic() < deadline, f"not within {GUARD_S} s: {what}"
        await asyncio.sleep(0.001)


async def status(key: str, store: TenantStore) -> int:
    try:
        await provide_principal(request(key), store)  # type: ignore[arg-type]
    except Unauthenticated:
        return 401
    except Unavailable as exc:
        assert exc.code == "key_lookups_busy" and exc.retry_after
        return 503
    return 200


async def test_a_flood_of_made_up_keys_does_not_stall_the_event_loop(db: Database) -> None:
    """The flood's queries wait for the database, which answers only when the test lets it: meanwhile a cached
    tenant is answered, the lookups past the bound are refused, and the loop runs the test's own polling. On the
    loop, the first query would hold all of it until its guard (GUARD_S) gave up."""
    store = db.store
    db.answering.clear()
    flood = [asyncio.create_task(status(made_up_key(), store)) for _ in range(FLOOD)]
    victim = asyncio.create_task(provide_tenant(request(db.key), store))  # type: ignore[arg-type]
    await until(victim.done, "a cached tenant answered")
    await until(lambda: len(db.queries) >= LOOKUP_THREADS, "a query begun on each lookup thread")
    refused = [t.result() for t in flood if t.done()]
    assert not db.answering.is_set(), "a query held the event loop (it answered only when its guard gave up)"
    principal = victim.result()  # answered while every query waited: not behind the flood
    assert principal.tenant is not None and principal.tenant.name == "acme"
    assert refused == [503] * (FLOOD - MAX_LOOKUPS)  # past the bound: refused before any query answered
    db.answering.set()
    codes = await asyncio.gather(*flood)
    assert sorted(codes) == [401] * MAX_LOOKUPS + [503] * (FLOOD - MAX_LOOKUPS)  # never let in
    assert await status(made_up_key(), store) == 401  # the flood over, an unknown key is a plain 401 again
    _, fresh = store.issue_key("acme")  # a real key not cached yet: looked up off the loop, and let in
    assert await status(fresh, store) == 200 and await status(db.key, store) == 200
    assert not db.gave_up


async def test_after_a_change_a_flood_does_not_lock_real_keys_out(db: Database) -> None:
    """A change empties the caches: a tenant's next request is a lookup again, among the flood's, and still gets
    in (the bound on lookups at once is for ids never found to be keys), after at most MAX_LOOKUPS queries ahead of
    its own: counted, with the flood's lookups at their bound and held there until the tenant's is queued."""
    store, flooding = db.store, True
    db.answering.clear()

    async def attacker() -> set[int]:  # a made-up key again as soon as the last one is answered
        codes = set()
        while flooding:
            codes.add(await status(made_up_key(), store))
            await asyncio.sleep(0)
        return codes

    attackers = [asyncio.create_task(attacker()) for _ in range(FLOOD)]
    await until(lambda: len(store._pending) == MAX_LOOKUPS, "the lookups at once at their bound")
    store._invalidate()  # as when anyone commits a change
    asked_before, key_id = len(db.queries), parse_key(db.key)[0]  # type: ignore[index]
    tenant = asyncio.create_task(status(db.key, store))
    await until(lambda: tenant.done() or key_id in store._pending, "its lookup queued behind the flood's")
    db.answering.set()
    code = await tenant
    flooding = False
    assert set().union(*await asyncio.gather(*attackers)) == {401, 503}
    assert code == 200, f"a real key got {code}"
    own = next(i for i, (_, args) in enumerate(db.queries) if args == (key_id,))
    assert own - asked_before <= MAX_LOOKUPS, f"a real key waited for {own - asked_before} queries of the flood"
    assert not db.gave_up


async def test_concurrent_lookups_of_one_key_id_share_one_query(db: Database) -> None:
    store, probe = db.store, made_up_key()
    db.queries.clear()
    assert await asyncio.gather(*(status(probe, store) for _ in range(20))) == [401] * 20  # all come before it ends
    assert len(db.queries) == 1
    assert await status(probe, store) == 401 and len(db.queries) == 1  # and then answered from the cache


async def test_past_the_bound_a_lookup_is_refused_at_once_and_a_waiter_leaving_cancels_nothing(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound a lookup is refused before any query is answered, not queued behind them."""
    store, key = db.store, db.key
    monkeypatch.setattr("gateway.tenants.store_postgres.MAX_LOOKUPS", 4)
    db.answering.clear()
    lookups = [asyncio.create_task(status(made_up_key(), store)) for _ in range(10)]
    await until(lambda: sum(t.done() for t in lookups) >= 6, "six refused")
    assert not db.answering.is_set(), "the refusals waited for the database (a query held the event loop)"
    assert [t.result() for t in lookups if t.done()] == [503] * 6
    db.answering.set()
    assert sorted(await asyncio.gather(*lookups)) == [401] * 4 + [503] * 6
    probe = made_up_key()
    leaving = asyncio.create_task(status(probe, store))
    staying = asyncio.create_task(status(probe, store))
    await asyncio.sleep(0)
    leaving.cancel()
    assert await staying == 401 and leaving.cancelled() and not store._pending
    assert await status(key, store) == 200


async def test_the_sqlite_store_answers_the_same_on_the_loop(tmp_path: Path) -> None:
    store = TenantStore(tmp_path / "state.db")
    try:
        store.create_tenant("acme", "standard")
        _, key = store.issue_key("acme")
        assert await status(key, store) == 200 and await status(made_up_key(), store) == 401
        assert await status(key[:-1] + ("A" if key[-1] != "A" else "B"), store) == 401
    finally:
        store.close()


def test_the_model_routes_and_health_never_look_a_key_up_synchronously(gateway: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every route that reads a key goes through `authenticate_async`: the model routes' own fast path
    (gateway/routes/answering.py) and /health, which takes any key, included."""
    store = gateway.app.state.services.store

    def synchronous(presented: str) -> None:
        raise AssertionError("a key looked up on the event loop")

    monkeypatch.setattr(store, "authenticate", synchronous)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert c.post("/v1/completions", json={"model": "mid", "prompt": "hi"}).status_code == 200
    with gateway.client(made_up_key()) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": []}).status_code == 401
    with gateway.client(gateway.admin_key) as c:
        assert "tiers" in c.get("/health").json()


async def test_a_lookup_begun_before_a_revocation_is_not_joined_by_a_request_after_it(database_url: str) -> None:
    """Concurrent lookups of one id share one query, but not across a change: a lookup that began before the key was
    revoked may have read it active, and a request sent after the revocation (heard: the caches emptied) joined it and
    was let in. Its own lookup reads the key revoked: a 401; what the earlier one read is not cached either."""
    store = PostgresTenantStore(database_url)
    try:
        store.create_tenant("acme", "standard")
        key, plaintext = store.issue_key("acme")
        held = hold_first(store, "_fetch_entry")  # read before the revocation below, answered after it
        early = asyncio.ensure_future(store.authenticate_async(plaintext))
        assert await asyncio.to_thread(held.began.wait, 20)
        await store.admin(store.revoke_key, key.key_id)
        late = asyncio.ensure_future(store.authenticate_async(plaintext))
        held.let_go.set()
        assert await late is None, "a request after the revocation was let in by a lookup begun before it"
        assert await early is not None  # its request came before the revocation
        assert await store.authenticate_async(plaintext) is None
    finally:
        store.close()
