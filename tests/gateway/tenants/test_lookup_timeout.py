"""A key lookup that waits out its own statement timeout (PostgreSQL) is that request's retryable 503, not an outage of
the fleet database for every tenant.

The store's breaker (gateway/tenants/store_postgres.py) opens on a fault of the database or the way to it: queries
then fail at once for BREAKER_S, and the outage is logged as an error. A lookup cancelled by its statement timeout
(the keys table held by another session's lock: an operator's LOCK TABLE, a long ALTER) opened it too: every tenant
whose key or data version was not cached got a 503 `database_unavailable`, for a database that answered all along.
An admin change's timeout was already its own 503 (tests/gateway/tenants/test_admin_lock_wait.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from gateway.settings import Settings
from gateway.tenants import store_postgres
from gateway.tenants.store_postgres import BUSY_MESSAGE
from tests.conftest import Gateway

UNCACHEABLE = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def gateway_settings(gateway_settings: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """conftest's settings with the tenant store in PostgreSQL, its statements bounded at 0.3 s (set before the
    gateway's store makes its pool) and its lookups' lock waits by that alone (a lock timeout cuts them shorter:
    tests/gateway/tenants/test_lookup_lock_timeout.py), a breaker that, once open, stays open for the rest of the
    test, and no answer cache (no embedder to load at start-up)."""
    monkeypatch.setattr(store_postgres, "STATEMENT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(store_postgres, "BREAKER_S", 60.0)
    return gateway_settings.model_copy(update={"database_url": database_url, "tenant_lookup_lock_timeout_s": 0,
                                               "cache_enabled": False})


@pytest.fixture
def keys_locked(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session that will hold api_keys locked against reads (LOCK TABLE in its transaction)."""
    with psycopg.connect(database_url) as blocker:
        yield blocker


def test_a_lookup_past_its_statement_timeout_is_its_503_and_the_breaker_stays_closed(
        gateway: Gateway, keys_locked: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    with gateway.client(gateway.admin_key) as admin:  # a write: every replica's caches emptied, acme's key too
        assert admin.post("/admin/tenants", json={"name": "globex"}).status_code == 201
        other_key = admin.post("/admin/keys", json={"tenant": "globex", "name": "other"}).json()["key"]
    with caplog.at_level(logging.WARNING, logger="tiergate.tenants"), \
            gateway.client(gateway.tenant_key) as acme, gateway.client(other_key) as globex:
        keys_locked.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")  # lookups wait on it
        refused = acme.post("/v1/chat/completions", json=UNCACHEABLE)  # its lookup: cancelled at 0.3 s
        keys_locked.rollback()
        answered = globex.post("/v1/chat/completions", json=UNCACHEABLE)  # a key not looked up yet
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {"message": BUSY_MESSAGE, "type": "service_unavailable", "param": None,
                                        "code": "database_busy"}}
    assert answered.status_code == 200, answered.text  # the breaker stayed closed: another tenant is let in
    logged = [r for r in caplog.records if r.name == "tiergate.tenants"]
    assert not [r for r in logged if r.levelno >= logging.ERROR], caplog.text  # no outage in the log
    assert any("statement timeout" in r.getMessage() for r in logged), caplog.text  # the server's words, logged
