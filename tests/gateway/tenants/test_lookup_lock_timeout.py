"""A key lookup blocked by another session's table lock (PostgreSQL) gives up at its lock timeout, not its statement
timeout.

The lookups run on two threads of the store's own (gateway/tenants/store_postgres.py). While an operator's LOCK TABLE
or a long ALTER held api_keys, each lookup of a key not cached waited its statement timeout (5 s) on one of them, so
the queue backed up: N tenants whose keys were not cached waited up to N x 2.5 s for their 503s, and the tenants behind
them as long. A lookup now waits for a lock at most TIERGATE_TENANT_LOOKUP_LOCK_TIMEOUT_S (0.2 s), the same
`database_busy` 503; an admin's change still waits for a lock up to its statement timeout; and a key refused so is
refused again at once, without a query, for its Retry-After."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest

from gateway.errors import Unavailable
from gateway.settings import Settings
from gateway.tenants import store_postgres
from gateway.tenants.store_postgres import BUSY_MESSAGE, PostgresTenantStore
from tests.conftest import Gateway

UNCACHEABLE = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}
BUSY = {"error": {"message": BUSY_MESSAGE, "type": "service_unavailable", "param": None, "code": "database_busy"}}


@pytest.fixture
def gateway_settings(gateway_settings: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """conftest's settings with the tenant store in PostgreSQL (its default lock and statement timeouts), a breaker
    that, once open, stays open for the rest of the test, and no answer cache (no embedder to load at start-up)."""
    monkeypatch.setattr(store_postgres, "BREAKER_S", 60.0)
    return gateway_settings.model_copy(update={"database_url": database_url, "cache_enabled": False})


@pytest.fixture
def blocker(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session, to hold api_keys locked against reads (LOCK TABLE in its transaction)."""
    with psycopg.connect(database_url) as conn:
        yield conn


def _post(gateway: Gateway, key: str) -> httpx.Response:
    with gateway.client(key) as client:
        return client.post("/v1/chat/completions", json=UNCACHEABLE)


def test_lookups_blocked_by_a_lock_are_refused_at_their_lock_timeout_not_their_statement_timeout(
        gateway: Gateway, blocker: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Which timeout ended each lookup is the database's error, not a duration: LockNotAvailable is the lock
    timeout's (0.2 s; four lookups on two threads, 0.4 s in all), QueryCanceled the statement timeout's (5 s each,
    10 s in all)."""
    store = gateway.app.state.services.store
    ended: list[type[BaseException]] = []  # why each lookup failed: the database error behind its 503
    fetch = store._fetch_entry

    def recorded(key_id: str) -> Any:
        try:
            return fetch(key_id)
        except Unavailable as exc:
            ended.append(type(exc.__cause__))
            raise

    monkeypatch.setattr(store, "_fetch_entry", recorded)
    keys = [gateway.store.issue_key("acme", name=f"blocked {i}")[1] for i in range(4)]  # none cached by the gateway
    (_, later), = [gateway.store.issue_key("acme", name="later")]
    with caplog.at_level(logging.WARNING, logger="tiergate.tenants"), ThreadPoolExecutor(len(keys)) as clients:
        blocker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        refused = list(clients.map(lambda key: _post(gateway, key), keys))  # four lookups on two threads
        blocker.rollback()
        answered = _post(gateway, later)
    assert [r.status_code for r in refused] == [503] * len(keys), [r.text for r in refused]
    assert all(r.json() == BUSY and r.headers["retry-after"] == "1" for r in refused), [r.text for r in refused]
    assert ended == [psycopg.errors.LockNotAvailable] * len(keys), ended  # none waited out its statement timeout
    assert answered.status_code == 200, answered.text  # the lock let go: the breaker stayed closed
    logged = [r for r in caplog.records if r.name == "tiergate.tenants"]
    assert not [r for r in logged if r.levelno >= logging.ERROR], caplog.text  # no outage in the log
    assert any("lock timeout" in r.getMessage() for r in logged), caplog.text


def test_a_key_refused_for_a_lock_is_refused_again_without_a_query_until_its_retry_after(
        gateway: Gateway, blocker: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # long enough for the requests below on a busy machine (raising=False: the old code had no such window)
    monkeypatch.setattr(store_postgres, "BUSY_RETRY_AFTER_S", 3, raising=False)
    store = gateway.app.state.services.store
    asked: list[str] = []
    fetch = store._fetch_entry

    def counted(key_id: str) -> Any:
        asked.append(key_id)
        return fetch(key_id)

    monkeypatch.setattr(store, "_fetch_entry", counted)
    (hot_row, hot), (_, other) = (gateway.store.issue_key("acme", name=name) for name in ("hot", "other"))
    blocker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
    first = _post(gateway, hot)
    again = _post(gateway, hot)  # within its Retry-After: refused from the first's failure
    another = _post(gateway, other)  # another key is still asked
    blocker.rollback()
    released = _post(gateway, hot)  # the lock let go, but still within the hot key's Retry-After
    assert asked.count(hot_row.key_id) == 1 and len(asked) == 2, asked
    for refusal in (first, again, another, released):
        assert refusal.status_code == 503 and refusal.json() == BUSY, refusal.text
        assert refusal.headers["retry-after"] == "3"
    time.sleep(3)
    assert _post(gateway, hot).status_code == 200  # its Retry-After passed: asked again, and found
    assert asked.count(hot_row.key_id) == 2


async def test_an_admin_change_still_waits_for_a_lock_and_a_lookup_after_it_does_not(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """One connection, lent to an admin's change then to a lookup: the change waits out a lock held 1 s (past the
    lookups' 0.2 s, within its statement timeout), and the lookup after it gives up at the lock timeout again."""
    store = PostgresTenantStore(database_url, max_connections=1)
    blocker = psycopg.connect(database_url)
    try:
        store.create_tenant("acme", "standard")
        _, fresh = store.issue_key("acme", name="fresh")
        blocker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        threading.Timer(1.0, blocker.rollback).start()
        late, _ = await store.admin(store.issue_key, "acme", name="late")  # waits for the lock's end
        assert late.name == "late"
        blocker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        with caplog.at_level(logging.WARNING, logger="tiergate.tenants"), pytest.raises(Unavailable) as caught:
            await store.authenticate_async(fresh)
        blocker.rollback()
        assert (caught.value.code, caught.value.retry_after) == ("database_busy", 1)
        assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable), repr(caught.value.__cause__)
        assert "lock timeout" in caplog.text and "reaching the fleet database" not in caplog.text
    finally:
        blocker.close()
        store.close()
