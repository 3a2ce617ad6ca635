"""PostgreSQL's Idempotency-Key records are dated by the database's clock, never by a replica's: a replica whose own
clock is off (650 s here, ahead or behind) takes over no claim another replica still runs, nor makes a claim another
takes over at once. Dated by each replica's clock, a replica 650 s ahead took over a claim with 400 s of its lease left
(found in review): the owner's renewal failed, its answer matched no record, and both requests ran and were billed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from quotas.idempotency import Claim, Replay, Running
from quotas.idempotency_postgres import PostgresIdempotency

ROOT = Path(__file__).resolve().parents[2]
# a replica in a process of its own whose clock (time.time) is off by argv[2] seconds from its start: it claims
# argv[3] for request argv[4] and prints what it got
REPLICA = """
import asyncio, sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[2])
from quotas.idempotency_postgres import PostgresIdempotency

async def main():
    store = PostgresIdempotency(sys.argv[1])
    try:
        print(type(await store.begin("acme", sys.argv[3], "body", sys.argv[4], lease_s=600)).__name__)
    finally:
        await store.close()

asyncio.run(main())
"""


def replica_begins(url: str, off_s: float, key: str, owner: str) -> str:
    done = subprocess.run([sys.executable, "-c", REPLICA, url, str(off_s), key, owner], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout.strip()


async def test_a_replica_whose_clock_is_ahead_takes_over_no_live_claim(database_url: str) -> None:
    """A claims a key with 400 s of lease left (a 600 s lease renewed at a third); B, 650 s ahead, finds it running;
    A renews it and stores its answer, which B's retry replays."""
    a = PostgresIdempotency(database_url)
    try:
        claim = await a.begin("acme", "k1", "body", "req-A", lease_s=400)
        assert isinstance(claim, Claim)
        assert replica_begins(database_url, 650, "k1", "req-B") == "Running"
        assert await a.renew(claim, 600)
        await a.finish_alone(claim, {"text": "A's"}, 3600)
        assert await a.stored("acme", "k1", "body") == Replay({"text": "A's"})
        assert replica_begins(database_url, 650, "k1", "req-C") == "Replay"
    finally:
        await a.close()


@pytest.mark.parametrize("off_s", [-650, 650])
async def test_a_claim_made_by_a_replica_whose_clock_is_off_is_not_taken_over(database_url: str,
                                                                              off_s: float) -> None:
    """B, its clock off, claims a key for 600 s: A (a true clock) finds it running, not a lease long over (B behind)
    nor one that may be taken over at once; B's claim is never dated by A's clock either way."""
    a = PostgresIdempotency(database_url)
    try:
        assert replica_begins(database_url, off_s, "k2", "req-B") == "Claim"
        assert await a.begin("acme", "k2", "body", "req-A", lease_s=600) == Running()
    finally:
        await a.close()
