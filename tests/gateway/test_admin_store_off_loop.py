"""An admin write that waits on a locked tenant store does not freeze the gateway.

The embedded store is a SQLite file that the CLI and the other gateway processes of a host write too, and a writer
waits for another's lock up to the busy timeout (seconds); the fleet's PostgreSQL store waits for a lock up to its
statement timeout. The admin routes ran their store calls on the event loop, so while one waited every tenant's
requests, and /health, waited with it (then the admin got a 500 from SQLite, a 503 from PostgreSQL). Here another
connection holds the store's tables against writes while an admin write runs: a tenant's request and /health are
answered while the admin call still waits, and the admin call completes, once, when the lock is let go.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest

from gateway.settings import Settings
from gateway.tenants import store_sqlite
from gateway.tenants.store import TenantStore
from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]

# an admin write: (method, path or a path made from a key id of acme's, body, status, what it leaves in the store)
WRITES: dict[str, tuple[str, Callable[[str], str], dict[str, Any] | None, int, Callable[[TenantStore, str], bool]]] = {
    "issue": ("POST", lambda _: "/admin/keys", {"tenant": "acme", "name": "late"}, 201,
              lambda s, _: [k.name for k in s.list_keys("acme")].count("late") == 1),
    "create tenant": ("POST", lambda _: "/admin/tenants", {"name": "globex"}, 201,
                      lambda s, _: "globex" in {t.name for t in s.list_tenants()}),
    "revoke": ("POST", lambda key_id: f"/admin/keys/{key_id}/revoke", None, 200,
               lambda s, key_id: s.get_key(key_id).revoked_at is not None),
    "rotate": ("POST", lambda key_id: f"/admin/keys/{key_id}/rotate", {"grace_s": 0}, 201,
               lambda s, key_id: s.get_key(key_id).replaced_by is not None),
    "data version": ("POST", lambda _: "/admin/tenants/acme/data-version", None, 200,
                     lambda s, _: s.data_version("acme") == 1),
}


@pytest.fixture(params=["sqlite", "postgres"])
def gateway_settings(request: pytest.FixtureRequest, gateway_settings: Settings) -> Settings:
    """conftest's settings: the tenant store in the data directory (SQLite) or in PostgreSQL."""
    if request.param == "sqlite":
        return gateway_settings
    return gateway_settings.model_copy(update={"database_url": request.getfixturevalue("database_url")})


@contextmanager
def write_locked(gw: Gateway) -> Iterator[Callable[[], None]]:
    """Another connection holds the tenant store against writes (as a CLI command or another process mid-write;
    PostgreSQL: reads go on) until the returned function lets it go."""
    if gw.settings.database_url:
        with psycopg.connect(gw.settings.database_url) as pg:
            pg.execute("LOCK TABLE tenants, api_keys, tenant_data_versions IN SHARE MODE")
            yield pg.rollback
        return
    blocker = sqlite3.connect(gw.settings.state_db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        yield lambda: blocker.execute("ROLLBACK")
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()


def writes_reached(store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when the gateway's store is about to write (a statement, or an exclusive transaction's start)."""
    reached = threading.Event()
    execute, exclusive = store._execute, store._exclusive

    def noted_execute(sql: str, args: tuple[Any, ...] = ()) -> None:
        reached.set()
        execute(sql, args)

    def noted_exclusive() -> Any:
        reached.set()
        return exclusive()

    monkeypatch.setattr(store, "_execute", noted_execute)
    monkeypatch.setattr(store, "_exclusive", noted_exclusive)
    return reached


@pytest.mark.parametrize("write", WRITES)
def test_tenants_are_served_while_an_admin_write_waits_on_the_store_s_lock(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch, write: str) -> None:
    method, path, body, status, landed = WRITES[write]
    key, _ = gateway.store.issue_key("acme", name="old")  # for revoke and rotate (through the CLI's connection)
    with gateway.client(gateway.tenant_key) as tenant:  # the tenant's key cached, as a busy gateway's are
        assert tenant.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}).status_code == 200
    reached = writes_reached(gateway.app.state.services.store, monkeypatch)
    with write_locked(gateway) as let_go, ThreadPoolExecutor(1) as pool, \
            gateway.client(gateway.admin_key) as admin, gateway.client(gateway.tenant_key) as tenant:
        waiting = pool.submit(admin.request, method, path(key.key_id), json=body)
        assert reached.wait(20), "the admin call never reached the store"
        # the admin call waits on the lock (up to the busy timeout, seconds); meanwhile the gateway serves
        answered = tenant.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
        health = httpx.get(f"{gateway.url}/health", timeout=30)
        assert not waiting.done(), ("a tenant's request was answered only after the admin call: the event loop "
                                    f"waited with it ({waiting.result().status_code})")
        assert answered.status_code == 200, answered.text
        assert "status" in health.json(), health.text  # answered ("starting" here: tier small is down on purpose)
        let_go()
        r = waiting.result(timeout=30)
    assert r.status_code == status, r.text
    assert landed(gateway.store, key.key_id), "the admin write did not land once the lock was let go"


@pytest.mark.parametrize("gateway_settings", ["sqlite"], indirect=True)
def test_a_write_still_locked_out_at_the_busy_timeout_is_a_retryable_503(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Past SQLite's busy timeout the admin read a 500 with nothing to do; now a 503 that says the store was busy and
    nothing changed, with Retry-After, and the driver's words ("database is locked") are not in it."""
    monkeypatch.setattr(store_sqlite, "BUSY_TIMEOUT_S", 0.2)  # the admin thread's connection, opened on first use
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        with write_locked(gateway), caplog.at_level(logging.WARNING, logger="tiergate.tenants"):
            r = admin.post("/admin/keys", json={"tenant": "acme", "name": "late"})
        assert "database is locked" in caplog.text  # the driver's words: the log's
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "database_busy"), error
        assert "locked" not in error["message"] and "retry" in error["message"], error
        assert admin.get("/admin/keys").json()["data"] == before  # nothing was made
        assert admin.post("/admin/keys", json={"tenant": "acme", "name": "late"}).status_code == 201
