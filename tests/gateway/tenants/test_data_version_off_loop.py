"""A tenant's data version that the store has not cached is read off the event loop (PostgreSQL: a network wait).

Every write (an admin's, any tenant's data-version bump, another replica's change heard by the listener) empties
every tenant's cached version, so each tenant's next cacheable request reads it again. On PostgreSQL that read was a
synchronous query on the gateway's event loop (the cache stage's scope): with the database slow, or
tenant_data_versions locked (a migration, an operator's LOCK TABLE), every tenant's requests and /health waited with
it, up to the statement timeout (seconds). Here another session holds the table locked while a tenant's cacheable
request reads its version: another tenant's request and /health are answered while that read still waits, and the
request is answered once the lock is let go. The read keeps its rules: a read begun before a change that emptied the
caches is neither joined by a request after it nor cached; SQLite's (local) read stays on the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest

from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from gateway.tenants.store_postgres import PostgresTenantStore
from tests.conftest import Gateway
from tests.gateway.tenants.held_reads import hold_first

MSG = [{"role": "user", "content": "hi"}]
CACHEABLE = {"model": "mid", "messages": MSG, "temperature": 0}  # deterministic: its scope names the data version
UNCACHEABLE = {"model": "mid", "messages": MSG}  # temperature unset: the cache is bypassed, no version is read


@pytest.fixture
def gateway_settings(gateway_settings: Settings, database_url: str) -> Settings:
    """conftest's settings with the tenant store in PostgreSQL."""
    return gateway_settings.model_copy(update={"database_url": database_url})


def version_reads(store: TenantStore) -> threading.Event:
    """Set when `store` starts reading acme's data version (on whichever thread)."""
    reached = threading.Event()
    fetchone = store._fetchone

    def noted(sql: str, args: tuple[Any, ...] = ()) -> Any:
        if "tenant_data_versions" in sql and args == ("acme",):
            reached.set()
        return fetchone(sql, args)

    store._fetchone = noted  # type: ignore[method-assign]
    return reached


@pytest.fixture
def versions_locked(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session that will hold tenant_data_versions locked against reads (LOCK TABLE in its transaction)."""
    with psycopg.connect(database_url) as blocker:
        yield blocker


def test_tenants_are_served_while_one_s_data_version_read_waits_on_a_lock(
        gateway: Gateway, versions_locked: psycopg.Connection[Any]) -> None:
    with gateway.client(gateway.admin_key) as admin:
        assert admin.post("/admin/tenants", json={"name": "globex"}).status_code == 201
        other_key = admin.post("/admin/keys", json={"tenant": "globex", "name": "other"}).json()["key"]
    with gateway.client(gateway.tenant_key) as acme, gateway.client(other_key) as globex:
        for client in (acme, globex):  # keys and versions cached, as a busy gateway's are
            assert client.post("/v1/chat/completions", json=CACHEABLE).status_code == 200
    reached = version_reads(gateway.app.state.services.store)
    versions_locked.execute("LOCK TABLE tenant_data_versions IN ACCESS EXCLUSIVE MODE")  # reads wait too
    with ThreadPoolExecutor(1) as pool, gateway.client(gateway.admin_key) as admin, \
            gateway.client(gateway.tenant_key) as acme, gateway.client(other_key) as globex:
        # an admin write that does not touch the locked table empties every tenant's cached version
        assert admin.post("/admin/tenants", json={"name": "initech"}).status_code == 201
        waiting = pool.submit(acme.post, "/v1/chat/completions", json=CACHEABLE)
        assert reached.wait(20), "acme's request never read its data version"
        # acme's read waits on the lock (up to the statement timeout, seconds); meanwhile the gateway serves
        answered = globex.post("/v1/chat/completions", json=UNCACHEABLE)
        health = httpx.get(f"{gateway.url}/health", timeout=30)
        assert not waiting.done(), ("another tenant was answered only after acme's data-version read: the event "
                                    f"loop waited with it ({waiting.result().status_code})")
        assert answered.status_code == 200, answered.text
        assert "status" in health.json(), health.text  # answered ("starting" here: tier small is down on purpose)
        versions_locked.rollback()
        r = waiting.result(timeout=30)
    assert r.status_code == 200, r.text


async def test_a_version_read_begun_before_a_change_is_neither_joined_nor_cached(database_url: str) -> None:
    """A read that began before a change emptied the caches may hold the version from before it: a request after the
    change reads again (its own query), and the earlier read, finishing last, does not put its answer in the cache."""
    store = PostgresTenantStore(database_url)
    try:
        store.create_tenant("acme", "standard")
        held = hold_first(store, "_fetch_version")  # read before the bump below, answered after it
        early = asyncio.ensure_future(store.data_version_async("acme"))
        assert await asyncio.to_thread(held.began.wait, 20)
        assert await store.admin(store.bump_data_version, "acme") == 1
        assert await store.data_version_async("acme") == 1  # not the read in flight: that one may hold 0
        held.let_go.set()
        assert await early == 0  # its request began before the bump
        read = held.calls
        assert await store.data_version_async("acme") == 1 and held.calls == read  # 1 is cached, 0 was not
    finally:
        store.close()


async def test_sqlite_reads_a_version_on_the_loop(tmp_path: Any) -> None:
    """SQLite's query is local (~0.1 ms): read where it is asked, with no hop to a thread and back."""
    store = TenantStore(tmp_path / "state.db")
    try:
        store.create_tenant("acme", "standard")
        fetch, threads = store._fetch_version, []

        def noted(tenant: str) -> int:
            threads.append(threading.get_ident())
            return fetch(tenant)

        store._fetch_version = noted  # type: ignore[method-assign]
        assert await store.data_version_async("acme") == 0
        assert await store.data_version_async("acme") == 0  # cached
        assert threads == [threading.get_ident()]
    finally:
        store.close()
