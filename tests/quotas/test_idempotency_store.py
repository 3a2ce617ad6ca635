"""Idempotency-Key records, on SQLite and on PostgreSQL: the first request claims a key, a retry replays its
answer, another body is told apart, a crashed owner's lease ends, and a `done` record is durable with its
ledger row or not at all. What one tenant holds is bounded, there and on Redis: at its bound a new key is refused,
another tenant is not, expired records free room, and an answer too large is not stored (its key is kept as
answered: a retry is told so, never run again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quotas.idempotency import (
    NOT_KEPT,
    Claim,
    Full,
    IdempotencyStore,
    Limits,
    Mismatch,
    Replay,
    Running,
    not_kept,
)
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.idempotency_redis import RedisIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import Ledger
from tests.postgres import LedgerStore
from tests.quotas.test_ledger import row


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t

    def shift(self) -> float:
        """How far it has moved: PostgreSQL's records are dated by the database's clock, moved by this much."""
        return self.t - 1_000_000.0


def full_in(begun: object, s: float) -> bool:
    """Refused for a full tenant, told to retry in `s` (PostgreSQL's clock, the database's, runs on meanwhile)."""
    return isinstance(begun, Full) and s - 1 <= begun.retry_after_s <= s


@pytest.fixture
async def stores(ledger_store: LedgerStore) -> AsyncIterator[tuple[IdempotencyStore, Ledger, Clock]]:
    """The idempotency store beside its ledger (the same SQLite file, or the same PostgreSQL database)."""
    clock = Clock()
    ledger = ledger_store.open()
    store: IdempotencyStore = (SQLiteIdempotency(Path(ledger_store.target), clock=clock)
                               if ledger_store.kind == "sqlite" else PostgresIdempotency(ledger_store.target,
                                                                                         shift=clock.shift))
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


async def test_an_answer_whose_row_is_durable_is_stored_alone_and_its_size_counted(
        stores: tuple[IdempotencyStore, Ledger, Clock]) -> None:
    """`finish_alone` (a cascade's first answer that stands when its retry failed): stored in a write of its own, as a
    `done` record whose size counts towards the tenant's bound, and replayed; too large, the record that stands in for
    it (`NOT_KEPT`) is stored instead: a retry is told, not run again."""
    store, _, _ = stores
    store.limits = Limits(bytes=64, answer_bytes=64)
    large = await store.begin("acme", "k2", "body", "r1", lease_s=60)
    assert isinstance(large, Claim)
    await store.finish_alone(large, {"text": "x" * 100}, 3600)  # over the bound: not kept, but the key is answered
    assert await store.begin("acme", "k2", "body", "r2", lease_s=60) == Replay({NOT_KEPT: 111})
    claim = await store.begin("acme", "k1", "body", "r3", lease_s=60)
    assert isinstance(claim, Claim)
    answer = {"id": "chatcmpl-r3", "text": "Hello"}
    await store.finish_alone(claim, answer, 3600)
    assert await store.begin("acme", "k1", "body", "r4", lease_s=60) == Replay(answer)
    assert isinstance(await store.begin("acme", "k3", "body", "r5", lease_s=60), Full)  # its bytes count


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


async def test_a_tenant_at_its_bound_is_refused_new_keys_and_another_tenant_is_not(
        stores: tuple[IdempotencyStore, Ledger, Clock]) -> None:
    """Fresh keys on one cached answer stored a copy each for 24 h, without bound: the tenant's disk was everyone's."""
    store, ledger, _ = stores
    store.limits = Limits(records=3)
    claims = [await store.begin("acme", f"k{i}", "body", f"r{i}", lease_s=60) for i in range(3)]
    assert all(isinstance(c, Claim) for c in claims)
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(claims[0], {"text": "a"}, 3600)))
    refused = await store.begin("acme", "k3", "body", "r3", lease_s=60)
    assert isinstance(refused, Full) and 59 <= refused.retry_after_s <= 60  # when the first running claim's lease ends
    assert full_in(await store.begin("acme", "k3", "body", "r4", lease_s=60), 60)  # and nothing was held for it
    # the keys it holds still answer: a replay, a retry while running, another body
    assert await store.begin("acme", "k0", "body", "r5", lease_s=60) == Replay({"text": "a"})
    assert await store.begin("acme", "k1", "body", "r5", lease_s=60) == Running()
    assert await store.begin("acme", "k1", "other", "r5", lease_s=60) == Mismatch()
    assert isinstance(await store.begin("globex", "k3", "body", "r6", lease_s=60), Claim)  # another tenant's room
    await store.abandon(claims[1])  # a failed request's claim frees its place
    assert isinstance(await store.begin("acme", "k3", "body", "r7", lease_s=60), Claim)
    assert isinstance(await store.begin("acme", "k4", "body", "r8", lease_s=60), Full)


async def test_expired_records_do_not_count(stores: tuple[IdempotencyStore, Ledger, Clock]) -> None:
    store, ledger, clock = stores
    store.limits = Limits(records=2)
    done = await store.begin("acme", "done", "body", "r1", lease_s=60)
    assert isinstance(done, Claim)
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(done, {"text": "a"}, 100)))
    assert isinstance(await store.begin("acme", "crashed", "body", "r2", lease_s=30), Claim)  # its owner died
    assert full_in(await store.begin("acme", "new", "body", "r3", lease_s=60), 30)
    clock.t += 31  # the lease ended: its record no longer counts
    assert isinstance(await store.begin("acme", "new", "body", "r3", lease_s=60), Claim)
    assert full_in(await store.begin("acme", "other", "body", "r4", lease_s=60), 60)  # when `new`'s lease ends
    clock.t += 70  # the answer expired too: its key is a new one, and there is room for it and another
    assert isinstance(await store.begin("acme", "done", "another body", "r5", lease_s=60), Claim)
    assert isinstance(await store.begin("acme", "other", "body", "r6", lease_s=60), Claim)
    assert full_in(await store.begin("acme", "third", "body", "r7", lease_s=60), 60)


async def test_stored_bytes_are_bounded_and_a_too_large_answer_is_not_stored(
        stores: tuple[IdempotencyStore, Ledger, Clock]) -> None:
    store, ledger, _ = stores
    store.limits = Limits(records=100, bytes=1000, answer_bytes=600)
    big = await store.begin("acme", "big", "body", "r1", lease_s=60)
    assert isinstance(big, Claim)
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(big, {"text": "x" * 700}, 3600)))
    assert [r.request_id for r in ledger.rows()] == ["r1"]  # the request was answered and charged
    retry = await store.begin("acme", "big", "body", "r2", lease_s=60)  # told it ran: never run and charged again
    assert isinstance(retry, Replay) and not_kept(retry.answer) == 711
    assert await store.stored("acme", "big", "body") == retry
    for i in range(2):  # two answers of ~500 bytes reach the bound
        claim = await store.begin("acme", f"k{i}", "body", f"s{i}", lease_s=60)
        assert isinstance(claim, Claim)
        await ledger.wait_durable(ledger.submit(row(10 + i), with_row=store.finish_with_row(
            claim, {"text": "y" * 500}, 3600)))
    assert isinstance(await store.begin("acme", "k2", "body", "s2", lease_s=60), Full)
    assert isinstance(await store.begin("globex", "k2", "body", "s3", lease_s=60), Claim)


async def test_an_old_sqlite_file_gets_its_tenants_counted(tmp_path: Path) -> None:
    """A ledger file written before the bounds: its records count from the first start with them."""
    import sqlite3

    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        conn.execute("CREATE TABLE idempotency (tenant TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL, "
                     "owner TEXT NOT NULL, state TEXT NOT NULL, answer TEXT, expires REAL NOT NULL, "
                     "PRIMARY KEY (tenant, key))")
        conn.executemany("INSERT INTO idempotency VALUES ('acme', ?, 'body', 'r', 'done', '{}', 9e99)",
                         [(f"k{i}",) for i in range(2)])
    store = SQLiteIdempotency(tmp_path / "ledger.db", limits=Limits(records=3))
    try:
        assert await store.begin("acme", "k0", "body", "r1", lease_s=60) == Replay({})
        assert isinstance(await store.begin("acme", "k2", "body", "r1", lease_s=60), Claim)
        assert isinstance(await store.begin("acme", "k3", "body", "r1", lease_s=60), Full)
    finally:
        await store.close()


async def test_redis_bounds_a_tenant_as_the_databases_do(redis_url: str) -> None:
    store = RedisIdempotency(redis_url, limits=Limits(records=2, bytes=1000, answer_bytes=600))
    try:
        done = await store.begin("acme", "done", "body", "r1", lease_s=60)
        assert isinstance(done, Claim)
        await store.finish(done, {"text": "y" * 500}, 3600)
        short = await store.begin("acme", "short", "body", "r2", lease_s=0.3)  # its owner dies
        assert isinstance(short, Claim)
        refused = await store.begin("acme", "new", "body", "r3", lease_s=60)
        assert isinstance(refused, Full) and refused.retry_after_s == 1.0  # the lease ends within a second
        assert await store.begin("acme", "done", "body", "r4", lease_s=60) == Replay({"text": "y" * 500})
        assert await store.begin("acme", "short", "body", "r4", lease_s=60) == Running()
        assert isinstance(await store.begin("globex", "new", "body", "r5", lease_s=60), Claim)
        await asyncio.sleep(0.4)  # the lease ended: its record no longer counts
        big = await store.begin("acme", "new", "body", "r3", lease_s=60)
        assert isinstance(big, Claim)
        await store.finish(big, {"text": "x" * 700}, 3600)  # too large: not stored, but the key is answered
        assert await store.begin("acme", "new", "body", "r6", lease_s=60) == Replay({NOT_KEPT: 711})
        await store.abandon(Claim("acme", "new", "body", "r6"))  # another request's: gives nothing up
        assert await store.stored("acme", "new", "body") == Replay({NOT_KEPT: 711})
        store.limits = Limits(records=3, bytes=1000, answer_bytes=600)  # the two keys held, a third may come
        second = await store.begin("acme", "second", "body", "r7", lease_s=60)
        assert isinstance(second, Claim)
        await store.finish(second, {"text": "z" * 500}, 3600)  # ~1000 bytes stored: the bound in bytes
        store.limits = Limits(records=10, bytes=1000)
        assert isinstance(await store.begin("acme", "third", "body", "r8", lease_s=60), Full)
        store.limits = Limits(records=10, bytes=2000)
        assert isinstance(await store.begin("acme", "third", "body", "r8", lease_s=60), Claim)
    finally:
        await store.close()


async def test_a_running_claim_is_renewed_by_its_owner_only(stores: tuple[IdempotencyStore, Ledger, Clock]) -> None:
    """`renew` extends a running claim's lease (its request still runs), never another owner's claim or an answer;
    `stored` reads an answer without claiming anything (the gateway's replay while its ledger cannot write)."""
    store, ledger, clock = stores
    claim = await store.begin("acme", "k1", "body", "r1", lease_s=60)
    assert isinstance(claim, Claim) and await store.stored("acme", "k1", "body") is None
    clock.t += 50
    assert await store.renew(claim, 60)
    clock.t += 50  # past the first lease, within the renewed one
    assert await store.begin("acme", "k1", "body", "r2", lease_s=60) == Running()
    clock.t += 61  # not renewed since (its owner died): the key is taken over, and the old owner renews nothing
    taken = await store.begin("acme", "k1", "body", "r2", lease_s=60)
    assert isinstance(taken, Claim) and not await store.renew(claim, 60)
    await ledger.wait_durable(ledger.submit(row(1), with_row=store.finish_with_row(taken, {"text": "ok"}, 100)))
    assert not await store.renew(taken, 60)  # answered: its record is the answer's, for the TTL
    assert await store.stored("acme", "k1", "body") == Replay({"text": "ok"})
    assert await store.stored("acme", "k1", "other") == Mismatch()
    assert await store.stored("acme", "nope", "body") is None


async def test_redis_renews_a_running_claim_by_its_owner_only(redis_url: str) -> None:
    store = RedisIdempotency(redis_url)
    try:
        claim = await store.begin("acme", "renew-1", "body", "r1", lease_s=0.3)
        assert isinstance(claim, Claim) and await store.stored("acme", "renew-1", "body") is None
        for _ in range(3):  # 0.6 s in all: twice the lease
            await asyncio.sleep(0.2)
            assert await store.renew(claim, 0.3)
        assert await store.begin("acme", "renew-1", "body", "r2", lease_s=0.3) == Running()
        await asyncio.sleep(0.4)  # not renewed: the lease ends, the key is taken over
        taken = await store.begin("acme", "renew-1", "body", "r2", lease_s=60)
        assert isinstance(taken, Claim) and not await store.renew(claim, 0.3)
        await store.finish(taken, {"text": "ok"}, 100)
        assert not await store.renew(taken, 60)
        assert await store.stored("acme", "renew-1", "body") == Replay({"text": "ok"})
        assert await store.stored("acme", "renew-1", "other") == Mismatch()
    finally:
        await store.close()
