"""The tenant store's breaker (gateway/tenants/store_postgres.py) opens on a fault of the fleet database, not on a
burst of legitimate traffic: every connection of its pool lent out is a retryable 503 for the request that waited
too long, and the next request, a connection free again, is served. A pool that cannot make a connection at all
(the database refuses them) still opens it."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from gateway.errors import Unavailable
from gateway.tenants import store_postgres
from gateway.tenants.store_postgres import BUSY_MESSAGE, UNAVAILABLE_MESSAGE, PostgresTenantStore
from tests.postgres import PostgresServer

UNKNOWN = "tg-0123456789ab-" + "x" * 43  # well formed; no such key
OTHER = "tg-0123456789ac-" + "x" * 43  # another, never asked before: no answer of the store's caches can serve it


def test_every_connection_busy_is_a_503_for_that_request_and_does_not_open_the_breaker(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_postgres, "BREAKER_S", 60.0)  # had it opened, the next request would be refused
    store = PostgresTenantStore(database_url, max_connections=1, timeout_s=0.2)
    try:
        store.create_tenant("acme", "standard")
        _, plaintext = store.issue_key("acme")
        with store._connection(), pytest.raises(Unavailable) as caught:  # a request in flight holds the only one
            store.authenticate(UNKNOWN)
        assert store.authenticate(UNKNOWN) is None  # the connection is free again: served, not refused
        assert store.authenticate(plaintext) is not None
        err = caught.value
        assert (err.status_code, err.code, err.retry_after, err.message) == (503, "database_busy", 1, BUSY_MESSAGE)
    finally:
        store.close()


def test_a_pool_that_cannot_make_a_connection_still_opens_the_breaker(
        postgres_server: PostgresServer, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PostgresTenantStore(database_url, max_connections=1, timeout_s=0.5)
    name = database_url.rsplit("/", 1)[1]
    try:
        assert store.authenticate(UNKNOWN) is None
        with psycopg.connect(postgres_server.url(), autocommit=True) as admin:  # the database refuses connections
            admin.execute(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        with pytest.raises(Unavailable) as caught:  # (UNKNOWN's answer may be cached until the listener hears the
            store.authenticate(OTHER)              # connection end: a race the full suite's load lost once)
        assert (caught.value.code, caught.value.message) == ("database_unavailable", UNAVAILABLE_MESSAGE)
        asked: list[Any] = []
        monkeypatch.setattr(store._pool, "connection", lambda *a, **k: asked.append(a))
        with pytest.raises(Unavailable) as caught:
            store.authenticate(UNKNOWN)  # refused at once by the breaker, the pool not asked
        assert caught.value.code == "database_unavailable" and asked == []
    finally:
        with psycopg.connect(postgres_server.url(), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true")
        store.close()
