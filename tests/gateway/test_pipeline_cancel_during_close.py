"""A request cancelled again while its tier's stream is being closed still settles exactly once: the row is
written, and the dispatch slot, the gate's place and the quota's lease come back (before the fix the second
cancellation left `Pipeline.answer`'s `finally` at the close, skipping the settle: the reservation waited for the
reaper, holding the tenant's money and concurrency)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import gateway.pipeline.handle as handle
from tests.conftest import Gateway
from tests.gateway.test_pipeline_faults import SLOW, _wait


def test_a_client_that_leaves_and_is_cancelled_again_during_the_close_still_settles(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    closes = []

    async def cancelled_while_closing(upstream: Any) -> None:
        closes.append(upstream)
        raise asyncio.CancelledError  # a second cancellation, delivered at the close's await

    monkeypatch.setattr(handle, "_close_quietly", cancelled_while_closing)
    with gateway.client(gateway.tenant_key) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={"model": "mid", "messages": SLOW}, timeout=0.7)
    services = gateway.app.state.services
    _wait(lambda: gateway.ledger_rows())
    assert closes  # the close was reached, and cancelled
    (row,) = gateway.ledger_rows()
    assert row.status == "cancelled" and row.http_status == 499
    _wait(lambda: services.queues["mid"].in_flight == 0)
    assert services.queues["mid"].in_flight == 0  # the dispatch slot is back
    _wait(lambda: services.pipeline.gate.in_flight("acme") == 0)
    assert services.pipeline.gate.in_flight("acme") == 0  # the gate's place is back
    state = services.quota_backend._state["acme", "t"]
    _wait(lambda: state.inflight == {})
    assert state.inflight == {}  # the concurrency lease is settled, not left to the reaper
