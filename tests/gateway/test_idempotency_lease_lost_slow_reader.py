"""A streamed request whose Idempotency-Key lease is lost while its client is not reading (the gateway's send of a
chunk held by flow control, its answer's generators waiting at a `yield`) is stopped then, not when its client next
reads: its answer was left suspended, holding the tier's dispatch slot, the tenant's concurrency slot and the claim,
until the client read again or the stall cut (gateway/http_limits.py, 60 s) reset it, while a retry with the key could
take the expired key over and run. Now its work ends as the lease is lost: settled as a client that left is (billed
for what it had read), its slots freed and its claim given up, so a retry runs once, is stored and replayed; the first
client, once it reads, is told 503 `idempotency_lease_lost` as its stream's last event, never `[DONE]`.

The gateway runs in this test's loop (tests/gateway/cancel_sweep.py), its SQLite store's renewals made to fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from quotas.ledger import LedgerUnavailable
from tests.gateway.cancel_sweep import WORDS, InProcessGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEASE_S = 0.6  # renewals fail, so the lease is lost some 0.58 s after the claim
SETTLED_WITHIN_S = 20 * LEASE_S  # a bound for a slow machine; the old code never settled while the client held


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> AsyncIterator[InProcessGateway]:
    async with InProcessGateway(tmp_path_factory.mktemp("lease-slow"), prepared_models) as gateway:
        yield gateway


class Client:
    """One streamed POST /v1/chat/completions over ASGI whose reader stops reading at body message `hold_at` (its
    send waits until `read` is set), as a client that stops reading makes the server's flow control hold the send."""

    def __init__(self, gw: InProcessGateway, body: dict[str, Any], key: str, hold_at: int | None = None) -> None:
        self.state: dict[str, Any] = {}
        self.held = asyncio.Event()  # the send of body message `hold_at` waits
        self.read = asyncio.Event()  # the client reads again
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self._over = asyncio.Event()
        data = json.dumps(body).encode()
        raw = [(b"host", b"gateway"), (b"authorization", f"Bearer {gw.key}".encode()),
               (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               (b"idempotency-key", key.encode())]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "", "headers": raw,
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080), "state": self.state}
        sent = 0
        asked = False

        async def receive() -> dict[str, Any]:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": data, "more_body": False}
            await self._over.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal sent
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
                return
            sent += 1
            if sent == hold_at:
                self.held.set()
                await self.read.wait()
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self._over.set()

        self.task = asyncio.create_task(gw.app(scope, receive, send))

    async def done(self) -> Client:
        await self.task
        self._over.set()
        return self

    def events(self) -> list[str]:
        return [line.removeprefix("data: ") for line in self.body.decode().splitlines() if line.startswith("data: ")]


async def until(check: Any, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture
def failing_renewals(gw: InProcessGateway) -> Any:
    stage = gw.services.pipeline.idempotency
    lease_s = stage.lease_s

    async def renew(*_: Any) -> bool:
        raise LedgerUnavailable("database is locked")

    stage.lease_s = LEASE_S
    stage.store.renew = renew
    yield stage
    stage.lease_s = lease_s
    if "renew" in vars(stage.store):
        del stage.store.renew


async def test_a_lease_lost_while_the_client_is_not_reading_stops_the_request_at_once(
        gw: InProcessGateway, failing_renewals: Any) -> None:
    services = gw.services
    body = {"model": "mid", "stream": True, "messages": [{"role": "user", "content": "a reader that stops"}]}
    first = Client(gw, body, "slow-reader", hold_at=2)  # the role chunk is sent, the first word's waits
    try:
        await asyncio.wait_for(first.held.wait(), 30)
        request_id = first.state["request_id"]
        settled = await until(lambda: services.ledger.get(request_id) is not None
                              and services.queues["mid"].in_flight == 0
                              and services.pipeline.gate.in_flight("acme") == 0, SETTLED_WITHIN_S)
        assert settled, "its lease was lost and the request still held its slots, unsettled, while its client held"
        assert not first.task.done() and not first.read.is_set()  # the client still does not read
        row = services.ledger.get(request_id)
        assert row is not None and (row.status, row.http_status) == ("cancelled", 499)
        assert 0 < row.output_tokens < len(WORDS) and row.price_usd > 0  # what it had read, billed as a cancel is

        del failing_renewals.store.renew  # the store renews again
        failing_renewals.lease_s = 600.0
        retry = await Client(gw, body, "slow-reader").done()  # the claim was given up: the retry runs
        assert retry.status == 200 and retry.headers.get("x-tiergate-idempotent-replay") is None
        assert retry.events()[-1] == "[DONE]"
        await gw.quiesce()
        again = await Client(gw, body, "slow-reader").done()  # and is what the key keeps
        assert again.headers.get("x-tiergate-idempotent-replay") == "true"
        assert json.loads(again.events()[0])["id"] == json.loads(retry.events()[0])["id"]
    finally:
        first.read.set()
        await first.done()
    events = first.events()
    assert "[DONE]" not in events, "a stream stopped for its lease ended as if whole"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "idempotency_lease_lost" and error["param"] == "Idempotency-Key", error
    await gw.quiesce()
    assert services.ledger.get(request_id).status == "cancelled"  # settled once, as it was stopped
