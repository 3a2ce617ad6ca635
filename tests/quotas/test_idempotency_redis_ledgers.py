"""RedisIdempotency's claims, shared by replicas, looked up in the ledger the dead owner wrote, in each deployment
(a real redis-server, a real PostgreSQL): two replicas, A and B, share Redis; A's request claims a key and its gateway
dies, its lease lapses, and B gets the retry.
- one host (the workers of one data directory: one SQLite file) or a fleet database (PostgreSQL): B reads the
  ledger A wrote, so a billed request is told so (`lost()`) and one A never billed is taken over and runs;
- a SQLite file each (replicas on hosts of their own): A's row, if any, is in a file B cannot read. B looked only in
  its own, found nothing, took the key over and ran it a second time (billed twice); now B says it cannot tell
  (`unknown()`, the gateway's 409), billed or not, and never runs it under the key.
Which ledger a claim's owner writes is an id kept in that ledger's database (quotas/ledger_identity.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from quotas.idempotency import LOST, NOT_KEPT, UNKNOWN, Claim, Mismatch, Replay, lost, unknown
from quotas.idempotency_redis import RedisIdempotency
from quotas.ledger import Ledger
from quotas.ledger_identity import ledger_id
from quotas.ledger_postgres import PostgresLedger
from tests.quotas.test_ledger import row

LEASE_S = 0.3
SHARED = ("one host", "fleet database")


@dataclass
class Replica:
    store: RedisIdempotency
    ledger: Ledger


@pytest.fixture(params=["one host", "fleet database", "a file each"])
def ledgers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Ledger, Ledger]]:
    """A's ledger and B's: one SQLite file (two handles, as two worker processes hold), one PostgreSQL database,
    or a SQLite file each, at the same path on two 'hosts' (directories)."""
    if request.param == "one host":
        pair = (Ledger(tmp_path / "ledger.db"), Ledger(tmp_path / "ledger.db"))
    elif request.param == "fleet database":
        url = request.getfixturevalue("database_url")
        pair = (PostgresLedger(url), PostgresLedger(url))
    else:
        pair = (Ledger(tmp_path / "a" / "ledger.db"), Ledger(tmp_path / "b" / "ledger.db"))
    yield pair
    for ledger in pair:
        ledger.close()


@pytest.fixture
async def replicas(redis_url: str, ledgers: tuple[Ledger, Ledger]) -> AsyncIterator[tuple[Replica, Replica]]:
    pair = []
    for ledger in ledgers:
        store = RedisIdempotency(redis_url)
        store.rows = ledger  # as gateway/stores.py's open_idempotency hands it the gateway's ledger
        pair.append(Replica(store, ledger))
    yield pair[0], pair[1]
    for replica in pair:
        await replica.store.close()


def shared(request: pytest.FixtureRequest) -> bool:
    return request.node.callspec.params["ledgers"] in SHARED


async def died(a: Replica, *, billed: bool) -> None:
    """A's request r1 claims k1; its row commits (billed) or not, then its gateway dies before the answer is stored,
    and its lease ends."""
    assert isinstance(await a.store.begin("acme", "k1", "body", "r1", lease_s=LEASE_S), Claim)
    if billed:
        a.ledger.record_now([row(1)])
    await asyncio.sleep(LEASE_S + 0.1)


async def test_a_retry_after_a_billed_owner_died_is_never_run_again(replicas: tuple[Replica, Replica],
                                                                     request: pytest.FixtureRequest) -> None:
    a, b = replicas
    await died(a, billed=True)
    for retry in ("r2", "r3"):  # every retry is told, none runs
        assert await b.store.begin("acme", "k1", "body", retry, lease_s=60) == (lost() if shared(request) else
                                                                                 unknown())
    assert await b.store.begin("acme", "k1", "another body", "r4", lease_s=60) == Mismatch()
    assert b.ledger.get("r2") is None and b.ledger.get("r3") is None


async def test_a_retry_after_an_unbilled_owner_died_runs_only_where_its_ledger_is_read(
        replicas: tuple[Replica, Replica], request: pytest.FixtureRequest) -> None:
    """No row: B takes the key over where it reads A's ledger; with a file each, A's may hold a row B cannot see (it
    died between its row and its answer), so B cannot tell this case from the one above, and runs neither."""
    a, b = replicas
    await died(a, billed=False)
    begun = await b.store.begin("acme", "k1", "body", "r2", lease_s=60)
    assert begun == (Claim("acme", "k1", "body", "r2") if shared(request) else unknown())


def test_two_replicas_agree_on_their_ledger_exactly_when_they_share_it(ledgers: tuple[Ledger, Ledger],
                                                                      request: pytest.FixtureRequest) -> None:
    a, b = (ledger_id(ledger.read_source()) for ledger in ledgers)
    assert a and b and (a == b) == shared(request)
    assert ledger_id(ledgers[0].read_source()) == a  # made once, then read


async def test_a_claim_from_before_ledger_ids_is_looked_up_here_and_else_not_run(redis_url: str,
                                                                                tmp_path: Path) -> None:
    """A claim of a replica of the previous release (no ledger id in its record, during a rolling upgrade): its row
    found in this gateway's ledger, the retry is told it was billed; not found, it may be in another ledger, so not
    run either."""
    ledger = Ledger(tmp_path / "ledger.db")
    store = RedisIdempotency(redis_url)
    store.rows = ledger
    try:
        for key, billed in (("k1", True), ("k2", False)):
            owner = f"r-{key}"
            assert isinstance(await store.begin("acme", key, "body", owner, lease_s=LEASE_S), Claim)
            _forget_ledger_id(redis_url, f"tg:idem:acme:{key}")
            if billed:
                ledger.record_now([dataclasses.replace(row(1), request_id=owner)])
        await asyncio.sleep(LEASE_S + 0.1)
        first = await store.begin("acme", "k1", "body", "again-1", lease_s=60)
        assert isinstance(first, Replay) and first.answer[LOST] and UNKNOWN not in first.answer
        assert await store.begin("acme", "k2", "body", "again-2", lease_s=60) == unknown()
        assert unknown().answer[NOT_KEPT] == 0  # the gateway's 409 of an answer not kept
    finally:
        await store.close()
        ledger.close()


def _forget_ledger_id(url: str, name: str) -> None:
    """The record as the previous release wrote it: without `ledger`."""
    with redis.Redis.from_url(url) as r:
        rec = json.loads(r.get(name))
        del rec["ledger"]
        r.set(name, json.dumps(rec), px=r.pttl(name))
