"""A key id the tenant store has not cached is looked up off the event loop (PostgreSQL: a network round trip).

Anyone can send `Authorization: Bearer tg-<made-up id>-…`, a new id each time; with the fleet database each was a
synchronous query on the gateway's event loop, so a flood of them stalled every tenant's requests. Here the
database is slowed (each query waits DELAY_S on the calling thread, as a round trip to a remote database does)
and the gateway's authentication (gateway/auth.py, as the routes call it) is flooded with made-up keys: the loop
stays responsive, a cached tenant is answered at once, made-up keys get 401 (or a quick 503 past the bound on
lookups at once), real keys still authenticate, and concurrent lookups of one id share one query.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.auth import provide_principal, provide_tenant
from gateway.errors import Unauthenticated, Unavailable
from gateway.tenants.store import TenantStore
from gateway.tenants.store_postgres import PostgresTenantStore
from tests.gateway.tenants.held_reads import hold_first

DELAY_S = 0.005  # each query's round trip
FLOOD = 200  # made-up keys sent at once: on the event loop, 200 round trips = a second of nobody served


def request(key: str) -> Any:
    """What gateway/auth.py reads of a request: its headers (and as the ASGI scope has them: a repeated key header
    is refused), and its state (where the key id goes)."""
    return SimpleNamespace(headers={"authorization": f"Bearer {key}"}, state=SimpleNamespace(),
                           scope={"headers": [(b"authorization", f"Bearer {key}".encode())]})


def made_up_key() -> str:
    return f"tg-{secrets.token_hex(6)}-{secrets.token_urlsafe(32)}"


@pytest.fixture
def slow_store(database_url: str) -> Iterator[tuple[PostgresTenantStore, list[str], str]]:
    """A PostgreSQL store whose every query takes DELAY_S more (counted), with tenant acme's key cached."""
    store = PostgresTenantStore(database_url)
    store.create_tenant("acme", "standard")
    _, key = store.issue_key("acme")
    queries: list[str] = []
    real = store._fetchone

    def counted(sql: str, args: tuple[Any, ...] = ()) -> Any:
        queries.append(sql)
        return real(sql, args)

    store._fetchone = counted  # type: ignore[method-assign]
    deadline = time.monotonic() + 2
    while queries or store.authenticate(key) is None or queries:  # cached, once the listener follows the changes
        assert time.monotonic() < deadline, "the key was not cached within 2 s"
        queries.clear()
        time.sleep(0.01)

    def slow(sql: str, args: tuple[Any, ...] = ()) -> Any:
        queries.append(sql)
        time.sleep(DELAY_S)
        return real(sql, args)

    store._fetchone = slow  # type: ignore[method-assign]
    yield store, queries, key
    store.close()


async def status(key: str, store: TenantStore) -> int:
    try:
        await provide_principal(request(key), store)  # type: ignore[arg-type]
    except Unauthenticated:
        return 401
    except Unavailable as exc:
        assert exc.code == "key_lookups_busy" and exc.retry_after
        return 503
    return 200


async def test_a_flood_of_made_up_keys_does_not_stall_the_event_loop(
        slow_store: tuple[PostgresTenantStore, list[str], str]) -> None:
    store, _, key = slow_store
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    flooding = True

    async def probe() -> None:  # how late the loop wakes a sleeper
        while flooding:
            t = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - t - 0.001)

    probing = asyncio.create_task(probe())
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    flood = [asyncio.create_task(status(made_up_key(), store)) for _ in range(FLOOD)]
    victim = asyncio.create_task(provide_tenant(request(key), store))  # type: ignore[arg-type]
    principal = await victim
    victim_s = time.monotonic() - t0
    codes = await asyncio.gather(*flood)
    flooding = False
    await probing
    assert principal.tenant is not None and principal.tenant.name == "acme"
    assert victim_s < 0.1, f"a cached tenant waited {victim_s * 1000:.0f} ms behind the flood"
    assert max(lags) < 0.1, f"the event loop stalled for {max(lags) * 1000:.0f} ms"
    assert set(codes) <= {401, 503} and 401 in codes  # never let in; refused quickly past the bound
    assert await status(made_up_key(), store) == 401  # the flood over, an unknown key is a plain 401 again
    _, fresh = store.issue_key("acme")  # a real key not cached yet: looked up off the loop, and let in
    assert await status(fresh, store) == 200 and await status(key, store) == 200


async def test_after_a_change_a_flood_does_not_lock_real_keys_out(
        slow_store: tuple[PostgresTenantStore, list[str], str]) -> None:
    """A change empties the caches: a tenant's next request is a lookup again, among the flood's, and still gets
    in (the bound on lookups at once is for ids never found to be keys), after a wait of a few queries at most."""
    store, _, key = slow_store
    flooding = True

    async def attacker() -> set[int]:  # a made-up key again as soon as the last one is answered
        codes = set()
        while flooding:
            codes.add(await status(made_up_key(), store))
            await asyncio.sleep(0)
        return codes

    attackers = [asyncio.create_task(attacker()) for _ in range(FLOOD)]
    await asyncio.sleep(0.05)  # the lookups at once at their bound, all of made-up ids
    store._invalidate()  # as when anyone commits a change
    t0 = time.monotonic()
    code = await status(key, store)
    waited_s = time.monotonic() - t0
    flooding = False
    assert set().union(*await asyncio.gather(*attackers)) == {401, 503}
    assert code == 200 and waited_s < 1.0, f"a real key got {code} after {waited_s * 1000:.0f} ms"


async def test_concurrent_lookups_of_one_key_id_share_one_query(
        slow_store: tuple[PostgresTenantStore, list[str], str]) -> None:
    store, queries, _ = slow_store
    probe = made_up_key()
    queries.clear()
    assert await asyncio.gather(*(status(probe, store) for _ in range(20))) == [401] * 20
    assert len(queries) == 1
    assert await status(probe, store) == 401 and len(queries) == 1  # and then answered from the cache


async def test_past_the_bound_a_lookup_is_refused_at_once_and_a_waiter_leaving_cancels_nothing(
        slow_store: tuple[PostgresTenantStore, list[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    store, _, key = slow_store
    monkeypatch.setattr("gateway.tenants.store_postgres.MAX_LOOKUPS", 4)
    t0 = time.monotonic()
    codes = await asyncio.gather(*(status(made_up_key(), store) for _ in range(10)))
    assert sorted(codes) == [401] * 4 + [503] * 6 and time.monotonic() - t0 < 1.0
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
