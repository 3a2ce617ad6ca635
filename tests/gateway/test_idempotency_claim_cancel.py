"""A client that leaves while its Idempotency-Key is claimed (SQLite's thread has committed the claim, the request
not yet told) must not leave the key `running` for its lease (a retry waiting, then 409, for 10 minutes):
gateway/pipeline/idempotency.py gives the claim up once it ends. Deterministic: the store's begin is held after it
claimed until the caller has been cancelled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.errors import Conflict
from gateway.pipeline.context import RequestContext
from gateway.pipeline.idempotency import IdempotencyStage
from gateway.tenants.records import ApiKey, Principal, Tenant
from quotas.idempotency import Claim
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.plans import Plan
from tests.conftest import Gateway

PLAN = Plan(allowed_tiers=["mid"], default_tier="mid")


class Body(BaseModel):
    text: str


def ctx(request_id: str) -> RequestContext:
    key = ApiKey("k1", "acme", "k", ("user",), 0.0, None, None, None)
    return RequestContext(request_id, Principal(key, Tenant("acme", "pro", 0.0)), PLAN, {"idempotency-key": "key-1"},
                          time.time(), time.perf_counter())


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteIdempotency]:
    s = SQLiteIdempotency(tmp_path / "idempotency.db")
    yield s
    await s.close()


def hold_answer(store: SQLiteIdempotency) -> tuple[asyncio.Event, asyncio.Event]:
    """The store's begin claims (committed), then its answer is held until `release` (`ran` set meanwhile)."""
    ran, release = asyncio.Event(), asyncio.Event()
    begin = store.begin

    async def late(*args: Any, **kwargs: Any) -> Any:
        out = await begin(*args, **kwargs)
        ran.set()
        await release.wait()
        return out

    store.begin = late  # type: ignore[method-assign]
    return ran, release


async def test_a_claim_whose_client_left_in_flight_is_given_up(store: SQLiteIdempotency) -> None:
    stage = IdempotencyStage(store, wait_s=0.3, poll_s=0.01)
    ran, release = hold_answer(store)
    first = asyncio.create_task(stage.begin(ctx("r1"), Body(text="hi"), route="test"))
    await ran.wait()  # the key is r1's in the database
    first.cancel()  # the client leaves before its request knows it holds the key
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    await stage.drain()  # the claim, handed off, is given up
    retry = await stage.begin(ctx("r2"), Body(text="hi"), route="test")  # a retry runs at once, not 409
    assert isinstance(retry, Claim) and retry.owner == "r2"


async def test_a_key_another_request_holds_stays_held(store: SQLiteIdempotency) -> None:
    """The request that left was only waiting on another's claim: that claim is not given up."""
    stage = IdempotencyStage(store, wait_s=0.3, poll_s=0.01)
    held = await stage.begin(ctx("r0"), Body(text="hi"), route="test")
    assert isinstance(held, Claim)
    ran, release = hold_answer(store)
    first = asyncio.create_task(stage.begin(ctx("r1"), Body(text="hi"), route="test"))
    await ran.wait()  # Running: r0 holds it
    first.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    await stage.drain()
    with pytest.raises(Conflict):
        await stage.begin(ctx("r2"), Body(text="hi"), route="test")


def test_an_answer_that_failed_as_it_was_stored_is_not_kept(gateway: Gateway) -> None:
    """gateway/pipeline/handle.py: the answer's statements failing to be made (`finish_with_row`) fails the request,
    and its claim is given up, not kept with an error row (a retry then waited 10 s and got 409 for the lease)."""
    store = gateway.app.state.services.pipeline.idempotency.store
    finish_with_row, calls = store.finish_with_row, []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the answer cannot be encoded")
        return finish_with_row(*args, **kwargs)

    store.finish_with_row = fails_once
    body = {"model": "mid", "messages": [{"role": "user", "content": "hello there"}]}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=body, headers={"idempotency-key": "k-fails"})
        assert first.status_code == 500
        retry = c.post("/v1/chat/completions", json=body, headers={"idempotency-key": "k-fails"})
        assert retry.status_code == 200 and "x-tiergate-idempotent-replay" not in retry.headers
    assert len(calls) == 2 and len(gateway.stub.requests) == 2  # the retry ran again


def test_an_embeddings_answer_that_cannot_be_stored_is_still_written_and_settled(gateway: Gateway) -> None:
    """gateway/embeddings_settle.py: `finish_with_row` failing skipped the row and the quota's settle (held for its
    lease); now the answer is written, settled and answered, not kept, and a retry runs again."""
    store = gateway.app.state.services.pipeline.idempotency.store
    finish_with_row, calls = store.finish_with_row, []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the answer cannot be encoded")
        return finish_with_row(*args, **kwargs)

    store.finish_with_row = fails_once
    body = {"model": "all-MiniLM-L6-v2", "input": ["hello there"]}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/embeddings", json=body, headers={"idempotency-key": "e-fails"})
        assert first.status_code == 200
        retry = c.post("/v1/embeddings", json=body, headers={"idempotency-key": "e-fails"})
        assert retry.status_code == 200 and "x-tiergate-idempotent-replay" not in retry.headers
    assert len(calls) == 2
    assert [(r.tier, r.status) for r in gateway.ledger_rows()] == [("embeddings", "ok")] * 2
