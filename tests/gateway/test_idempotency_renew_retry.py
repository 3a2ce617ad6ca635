"""An Idempotency-Key claim's lease outlives renewals that failed for a while (the store busy, unreachable): its
request still runs, so a retry with its key must wait (409), never take the key over, run and be charged again. The
renewal was tried again only a third of the lease later: two failures in a row, and the lease ended while its request
ran. Here the first two renewals fail after a wait, as SQLite busy past its timeout does; the retry keeps asking for
the key through one and a half leases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.errors import Conflict
from gateway.pipeline.idempotency import IdempotencyStage, Keep
from quotas.idempotency import Claim
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import LedgerUnavailable
from tests.gateway.test_idempotency_claim_cancel import Body, ctx

LEASE_S = 1.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteIdempotency]:
    s = SQLiteIdempotency(tmp_path / "ledger.db")
    yield s
    await s.close()


def failing_renewals(store: SQLiteIdempotency, failures: int, after_s: float) -> list[bool]:
    """The store's first `failures` renewals fail after `after_s` each; what each renewal gave, in order."""
    renew, outcomes = store.renew, []

    async def flaky(claim: Claim, lease_s: float) -> bool:
        if len(outcomes) < failures:
            outcomes.append(False)
            await asyncio.sleep(after_s)  # waiting on the database, as a busy one makes a renewal wait
            raise LedgerUnavailable("database is locked")
        outcomes.append(await renew(claim, lease_s))
        return outcomes[-1]

    store.renew = flaky  # type: ignore[method-assign]
    return outcomes


async def test_a_lease_outlives_renewals_that_failed_for_a_while(store: SQLiteIdempotency) -> None:
    stage = IdempotencyStage(store, wait_s=1.5 * LEASE_S, lease_s=LEASE_S, poll_s=0.01)
    outcomes = failing_renewals(store, failures=2, after_s=0.1)
    claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
    assert isinstance(claim, Claim)
    keep = Keep(claim, stage.renewing(claim))
    try:
        with pytest.raises(Conflict):  # r1 still runs: its key is held throughout, then 409
            retry = await stage.begin(ctx("r2"), Body(text="hi"), route="test")
            assert not isinstance(retry, Claim), "the lease ended while its request ran: the retry runs again"
    finally:
        keep.settle()
    assert outcomes[:3] == [False, False, True]  # renewed once the store answered, before the lease ended
