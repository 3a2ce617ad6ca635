"""The same Idempotency-Key from two tenants is two keys, on every store (SQLite, PostgreSQL, Redis): one tenant's
running claim, stored answer, other body, give-up or renewal is never the other's. A regression guard for the audit of
tenant isolation (nothing was found shared); each store's own behaviour is in tests/quotas/test_idempotency_store.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quotas.idempotency import Claim, IdempotencyStore, Mismatch, Replay, Running
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.idempotency_redis import RedisIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import Ledger
from tests.postgres import open_ledger_at
from tests.quotas.test_ledger import row


@pytest.fixture(params=["sqlite", "postgres", "redis"])
async def kept(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[IdempotencyStore, Ledger]]:
    """A store and a ledger its answers commit with (Redis: the SQLite ledger, the answer stored once it is durable)."""
    if request.param == "postgres":
        url = request.getfixturevalue("database_url")
        ledger = open_ledger_at(url)
        store: IdempotencyStore = PostgresIdempotency(url)
    else:
        ledger = Ledger(tmp_path / "ledger.db")
        store = (SQLiteIdempotency(tmp_path / "ledger.db") if request.param == "sqlite"
                 else RedisIdempotency(request.getfixturevalue("redis_url")))
    ledger.start()
    yield store, ledger
    await store.close()
    ledger.close()


async def answered(store: IdempotencyStore, ledger: Ledger, claim: Claim, answer: dict[str, str], n: int) -> None:
    await ledger.wait_durable(ledger.submit(row(n), with_row=store.finish_with_row(claim, answer, 3600)))
    await store.finish(claim, answer, 3600)  # Redis stores it now; the SQL stores did with the row


async def test_the_same_key_from_two_tenants_is_two_keys(kept: tuple[IdempotencyStore, Ledger]) -> None:
    store, ledger = kept
    acme = await store.begin("acme", "shared-key", "body", "a1", lease_s=60)
    assert isinstance(acme, Claim)
    globex = await store.begin("globex", "shared-key", "body", "g1", lease_s=60)  # acme's running claim is not its
    assert globex == Claim("globex", "shared-key", "body", "g1")
    assert await store.begin("globex", "shared-key", "other body", "g2", lease_s=60) == Mismatch()  # its own body
    assert await store.begin("acme", "shared-key", "body", "a2", lease_s=60) == Running()
    assert not await store.renew(Claim("globex", "shared-key", "body", "a1"), 60)  # acme's owner, globex's key
    await store.abandon(Claim("globex", "shared-key", "body", "a1"))  # gives nothing of either up
    assert await store.begin("acme", "shared-key", "body", "a2", lease_s=60) == Running()
    assert await store.begin("globex", "shared-key", "body", "g2", lease_s=60) == Running()

    await answered(store, ledger, acme, {"text": "acme's answer"}, 1)
    assert await store.begin("acme", "shared-key", "body", "a3", lease_s=60) == Replay({"text": "acme's answer"})
    assert await store.stored("globex", "shared-key", "body") is None  # still running there, and never acme's
    assert await store.begin("globex", "shared-key", "body", "g3", lease_s=60) == Running()
    await store.abandon(globex)
    assert await store.begin("acme", "shared-key", "body", "a4", lease_s=60) == Replay({"text": "acme's answer"})
    again = await store.begin("globex", "shared-key", "body", "g4", lease_s=60)  # runs anew: acme's is not its
    assert again == Claim("globex", "shared-key", "body", "g4")
    await answered(store, ledger, again, {"text": "globex's answer"}, 2)
    assert await store.stored("globex", "shared-key", "body") == Replay({"text": "globex's answer"})
    assert await store.stored("acme", "shared-key", "body") == Replay({"text": "acme's answer"})
