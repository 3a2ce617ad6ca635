"""An admin change that waits out its statement timeout on another session's lock (PostgreSQL) is the admin's
retryable 503, not an outage of the fleet database for every tenant.

The store's breaker (gateway/tenants/store_postgres.py) opens on a fault of the database or the way to it: queries
then fail at once for BREAKER_S, and the outage is logged as an error. An admin's issue or rotation that waited for a
lock another session held (an operator's LOCK TABLE, a long migration, a rotation elsewhere) opened it too: for a
second every tenant whose key or data version was not cached got a 503, for a database that answered all along."""

from __future__ import annotations

import logging

import psycopg
import pytest

from gateway.errors import Unavailable
from gateway.tenants import store_postgres
from gateway.tenants.store_postgres import UNAVAILABLE_MESSAGE, PostgresTenantStore


async def test_an_admin_change_timed_out_on_a_lock_does_not_open_the_breaker(
        database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(store_postgres, "STATEMENT_TIMEOUT_S", 0.3)
    store = PostgresTenantStore(database_url)
    store.create_tenant("acme", "standard")
    rotated, _ = store.issue_key("acme", name="rotated")
    fresh = [store.issue_key("acme", name=f"fresh {i}")[1] for i in range(2)]  # each looked up once, below
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE api_keys IN SHARE MODE")  # writes wait; reads go on
        changes = (lambda: store.admin(store.issue_key, "acme", name="late"),
                   lambda: store.admin(store.rotate_key, rotated.key_id))
        with caplog.at_level(logging.WARNING, logger="tiergate.tenants"):
            for change, key in zip(changes, fresh, strict=True):
                with pytest.raises(Unavailable) as caught:
                    await change()
                # the breaker stays closed: a tenant's key not cached yet is looked up, and let in
                principal = await store.authenticate_async(key)
                assert principal is not None and principal.tenant is not None
                err = caught.value
                assert (err.status_code, err.code, err.retry_after) == (503, "database_busy", 1), err.body()
                assert err.message != UNAVAILABLE_MESSAGE and "statement timeout" not in err.message
        assert "statement timeout" in caplog.text and "reaching the fleet database" not in caplog.text
        blocker.rollback()
        names = sorted(k.name for k in await store.admin(store.list_keys, "acme"))
        assert names == ["fresh 0", "fresh 1", "rotated"]  # nothing was made, nothing rotated
        assert (await store.admin(store.issue_key, "acme", name="late"))[0].name == "late"
    finally:
        blocker.close()
        store.close()
