"""Idempotency-Key records, on SQLite and on PostgreSQL: the first request claims a key, a retry replays its
answer, another body is told apart, a crashed owner's lease ends, and a `done` record is durable with its
ledger row or not at all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quotas.idempotency import (
    Claim,
    IdempotencyStore,
    Mismatch,
    PostgresIdempotency,
    Replay,
    Running,
    SQLiteIdempotency,
)
from quotas.ledger import Ledger
from tests.postgres import LedgerStore
from tests.quotas.test_ledger import row


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def stores(ledger_store: LedgerStore) -> AsyncIterator[tuple[IdempotencyStore, Ledger, Clock]]:
    """The idempotency store beside its ledger (the same SQLite file, or the same PostgreSQL database)."""
    clock = Clock()
    ledger = ledger_store.open()
    store: IdempotencyStore = (SQLiteIdempotency(Path(ledger_store.target), clock=clock)
                               if ledger_store.kind == "sqlite" else PostgresIdempotency(ledger_store.target,
                                                                                         clock=clock))
    ledger.start()
    yield store, ledger, clock
    await store.close()
    ledger.close()


async def test_a_key_is_claimed_once_and_its_answer_replayed(stores: tuple[IdempotencyStore, Ledger,
                                                                            Clock]) -> None:
    store, ledger, _ = stores
    claim = await store.begin("acme", "k1", "body-a", "r1", lease_s=60)
    assert claim == Claim("acme", "k1", "body-a", "r1")
    assert await store.begin("acme", "k1", "body-a", "r2", lease_s=60) == Running()
    assert await store.begin("acme", "k1", "body-b", "r2", lease_s=60) == Mismatch()
    assert isinstance(await store.begin("globex", "k1", "body-a", "r3", lease_s=60), Claim)  # keys are per tenant
    answer = {"id": "chatcmpl-r1", "text": "Hello", "usage": [3, 1]}
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(claim, answer, 3600)))
    assert await store.begin("acme", "k1", "body-a", "r4", lease_s=60) == Replay(answer)
    assert await store.begin("acme", "k1", "body-b", "r4", lease_s=60) == Mismatch()


async def test_the_answer_is_stored_with_its_ledger_row_or_not_at_all(stores: tuple[IdempotencyStore, Ledger,
                                                                                     Clock]) -> None:
    store, ledger, _ = stores
    ledger.record_now([row(1)])
    claim = await store.begin("acme", "k1", "body", "r1", lease_s=60)
    assert isinstance(claim, Claim)
    written = ledger.submit(row(1), with_row=store.finish_with_row(claim, {"text": "lost"}, 3600))  # a duplicate id
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        await ledger.wait_durable(written)
    assert await store.begin("acme", "k1", "body", "r2", lease_s=60) == Running()  # not done without its row
    await store.abandon(claim)
    assert isinstance(await store.begin("acme", "k1", "body", "r2", lease_s=60), Claim)  # a retry runs again


async def test_a_crashed_owners_lease_ends_and_an_answer_expires(stores: tuple[IdempotencyStore, Ledger,
                                                                                Clock]) -> None:
    store, ledger, clock = stores
    assert isinstance(await store.begin("acme", "k1", "body", "r1", lease_s=60), Claim)  # then the replica died
    clock.t += 61
    claim = await store.begin("acme", "k1", "body", "r2", lease_s=60)
    assert claim == Claim("acme", "k1", "body", "r2")
    await store.abandon(Claim("acme", "k1", "body", "r1"))  # the old owner's late abandon takes nothing
    await ledger.wait_durable(ledger.submit(row(2), with_row=store.finish_with_row(claim, {"text": "ok"}, 100)))
    assert await store.begin("acme", "k1", "body", "r3", lease_s=60) == Replay({"text": "ok"})
    clock.t += 101
    assert isinstance(await store.begin("acme", "k1", "other body", "r4", lease_s=60), Claim)


async def test_concurrent_first_requests_claim_a_key_once(stores: tuple[IdempotencyStore, Ledger,
                                                                         Clock]) -> None:
    store, _, _ = stores
    begun = await asyncio.gather(*(store.begin("acme", "k", "body", f"r{i}", lease_s=60) for i in range(20)))
    assert sum(isinstance(b, Claim) for b in begun) == 1 and all(isinstance(b, Claim | Running) for b in begun)


async def test_an_answer_with_logprobs_and_any_text_replays_as_it_was(stores: tuple[IdempotencyStore, Ledger,
                                                                                    Clock]) -> None:
    store, ledger, _ = stores
    claim = await store.begin("acme", "k2", "body", "r1", lease_s=60)
    assert isinstance(claim, Claim)
    token = {"token": "é\U0001f600\"\\\n", "logprob": -1.2345678901234567, "bytes": [195, 169, 240]}
    answer = {"id": "chatcmpl-r1", "text": "naïve \u2028 \"quoted\"", "created": 1_700_000_000, "tool_calls": None,
              "logprobs": [{**token, "top_logprobs": [token, {**token, "logprob": -1e-300}]}] * 3}
    await ledger.wait_durable(ledger.submit(row(2), with_row=store.finish_with_row(claim, answer, 3600)))
    assert await store.begin("acme", "k2", "body", "r2", lease_s=60) == Replay(answer)


async def test_a_replay_on_sqlite_does_not_wait_for_the_write_lock(tmp_path: Path) -> None:
    """A stored answer is read without taking the database's write lock, which the ledger's commits need: replays
    of a large answer must not queue behind them, nor they behind the replays."""
    import sqlite3

    ledger = Ledger(tmp_path / "ledger.db")
    store = SQLiteIdempotency(tmp_path / "ledger.db")
    ledger.start()
    claim = await store.begin("acme", "k1", "body-a", "r1", lease_s=60)
    assert isinstance(claim, Claim)
    answer = {"id": "chatcmpl-r1", "text": "Hello " * 1000}
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(claim, answer, 3600)))
    writer = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another writer holds the lock (as a long commit would)
    try:
        assert await asyncio.wait_for(store.begin("acme", "k1", "body-a", "r2", lease_s=60), 2) == Replay(answer)
        assert await asyncio.wait_for(store.begin("acme", "k1", "body-b", "r3", lease_s=60), 2) == Mismatch()
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        await store.close()
        ledger.close()
