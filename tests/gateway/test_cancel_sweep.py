"""A request stopped at every one of its suspension points in turn still settles exactly once, and money stays exact.

handle.py promises that from the reservation on an attempt settles exactly once whatever ends it, the client leaving
included. Here one chat request of each shape (JSON and stream; the cache bypassed, missed and hit, the hit found in
the process's map of recent answers or in the cache's store; with an Idempotency-Key; a stream read by a slow client,
each chunk's send held a moment; an upstream failing with a 5xx before its first byte or in the middle of its stream)
is driven through the real app (tests/gateway/cancel_sweep.py) and stopped after its k-th step, for every k from 1
until it ends first: its handler cancelled while it waits, or as what it waited for ends (its result lost), or its
client disconnecting. After each, once the gateway is quiet (its own hooks drained, no sleeps):

- nothing is held: no open reservation, the gate's and the tier queue's in-flight counts at zero;
- at most one ledger row for the request, priced exactly at its tokens (a hit at the plan's hit price), billing no
  more output than the upstream produced, none on a JSON answer that failed, and no less than a stream delivered;
  a client that got a whole answer has an `ok` row matching its usage;
- the quota store's spend moved by exactly the rows' prices, and its window holds the rows' tokens;
- an Idempotency-Key is not left claimed: a retry with it replays the answer the row billed, or runs anew where no
  answer was billed, never a 409;
- no task of the request is left running, and nothing was logged as an error or reported by the event loop (a task
  exception never retrieved);
- the tenant's next request (the plan allows one at a time) is answered.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from quotas.ledger import LedgerRow
from quotas.money import to_pico
from tests.gateway.cancel_sweep import WORDS, Answer, InProcessGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_STEPS = 400  # a request of more steps than this is swept up to here only (the longest here has 36)
_n = itertools.count()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> AsyncIterator[InProcessGateway]:
    async with InProcessGateway(tmp_path_factory.mktemp("sweep"), prepared_models) as gateway:
        yield gateway


def body(shape: str, n: int) -> dict[str, Any]:
    """The request of `shape`, its prompt new for `n` (a miss) unless the shape says otherwise."""
    stream = "stream" in shape
    content = {"fail500": f"FAIL:500 question {n}", "failmid": f"FAIL:mid question {n}",
               "hit": "the one question kept in the cache"}.get(shape.split("-")[0], f"question number {n}")
    out: dict[str, Any] = {"model": "mid", "messages": [{"role": "user", "content": content}], "stream": stream}
    if shape.startswith(("miss", "hit")):
        out["temperature"] = 0
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


class Ledger:
    def __init__(self, gw: InProcessGateway) -> None:
        self.gw = gw
        self.backend = gw.services.quota_backend

    def spent(self) -> int:
        day = time.strftime("%Y%m%d", time.gmtime())
        return self.backend.spend_of("acme", "t", day, day[:6])[0]

    def window_tokens(self, request_id: str) -> int:
        """The tokens the quota store's minute window holds for the request (what it reserved, settled to its use)."""
        scope = self.backend._state.get(("acme", "t"))
        return scope.tokens.get(request_id, 0) if scope is not None else 0

    def row(self, request_id: str) -> LedgerRow | None:
        return self.gw.services.ledger.get(request_id)


def delivered(answer: Answer, stream: bool) -> tuple[int, int | None, bool]:
    """What the client got: content pieces, the usage's completion tokens (None without usage), and whether it was a
    whole answer."""
    if answer.status != 200 or not answer.body:
        return 0, None, False
    if not stream:
        if not answer.complete:
            return 0, None, False
        usage = answer.json()["usage"]
        return usage["completion_tokens"], usage["completion_tokens"], True
    events = answer.events()
    pieces = sum(1 for e in events for c in e.get("choices") or () if c.get("delta", {}).get("content"))
    usage = next((e["usage"] for e in events if e.get("usage")), None)
    whole = answer.complete and answer.body.endswith(b"data: [DONE]\n\n") and not any("error" in e for e in events)
    return pieces, usage["completion_tokens"] if usage else None, whole


def key_state(gw: InProcessGateway, key: str) -> str | None:
    with sqlite3.connect(gw.settings.ledger_db) as conn:
        found = conn.execute("SELECT state FROM idempotency WHERE tenant = 'acme' AND key = ?", (key,)).fetchone()
    return found[0] if found else None


async def check_quiet(gw: InProcessGateway) -> None:
    """The request's tasks all ended; nothing held by the gate, the tier's queue or the quota store."""
    await gw.quiesce()
    assert gw.last is not None
    pending = [t for t in gw.last.tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=5)
    assert all(t.done() for t in gw.last.tasks), [t for t in gw.last.tasks if not t.done()]
    services = gw.services
    assert services.pipeline.gate.in_flight("acme") == 0
    queue = services.queues["mid"]
    assert (queue.in_flight, queue.num_waiting, queue.in_flight_by.get("acme", 0)) == (0, 0, 0)
    assert services.quota_backend.expired(float("inf")) == []  # no reservation open


def check_row(gw: InProcessGateway, answer: Answer, stream: bool, row: LedgerRow | None, hit: bool) -> None:
    pieces, usage, whole = delivered(answer, stream)
    if whole:
        assert row is not None and row.status == "ok", (answer, row)
        assert usage is None or row.output_tokens == usage, (answer, row)
    if row is None:
        assert pieces == 0, answer  # nothing delivered free
        return
    tier = gw.services.catalogue.tiers["mid"]
    if hit:
        tokens = row.input_tokens + row.output_tokens
        assert row.price_usd == Decimal("0.0001") * tokens / 1000, row
    else:
        assert row.price_usd == tier.price(row.input_tokens, row.output_tokens), row
    assert row.output_tokens <= len(WORDS), row  # never more than the upstream produced
    assert row.output_tokens >= pieces, (answer, row)  # never less than the client got
    if not stream and row.status == "error":
        assert row.output_tokens == 0, row  # a JSON answer that failed sent no output
    if row.status == "ok":
        assert row.http_status == 200


async def sweep(gw: InProcessGateway, shape: str, fault: str,
                caplog: pytest.LogCaptureFixture) -> tuple[int, set[str | None]]:
    """Stop a request of `shape` after each of its steps in turn, checking everything after each; the number of
    steps of the request when nothing stops it, and the statuses of the stopped requests' rows (None: no row)."""
    stream = "stream" in shape
    keyed = "key" in shape
    hit = shape.startswith("hit")
    gw.read_hits_from_store("store" in shape)  # the same path for every request of the sweep, whatever the clock
    ledger = Ledger(gw)
    if hit:  # the answer every request of the sweep hits
        first = await gw.request(body("hit", 0))
        assert first.status == 200, first
        await check_quiet(gw)
    caplog.set_level(logging.WARNING)
    k = 0
    seen: set[str | None] = set()
    while True:
        k += 1
        n = next(_n)
        key = f"key-{shape}-{fault}-{n}" if keyed else None
        headers = {"idempotency-key": key} if key else None
        spent = ledger.spent()
        answer = await gw.request(body(shape, n), headers=headers, at=k, fault=fault, slow=shape.endswith("slow"))
        await check_quiet(gw)
        row = ledger.row(answer.request_id) if answer.request_id else None
        check_row(gw, answer, stream, row, hit)
        if answer.fired:
            seen.add(row.status if row else None)
        assert ledger.spent() - spent == (to_pico(row.price_usd) if row else 0), (answer, row)
        backend_tokens = ledger.window_tokens(answer.request_id)
        if row is not None and not hit:
            assert backend_tokens == row.input_tokens + row.output_tokens, (row, backend_tokens)
        else:
            assert backend_tokens == 0, (answer, backend_tokens)
        if key is not None:
            assert key_state(gw, key) in (None, "done"), (answer, key_state(gw, key))
        # the next request: the key's retry where there is one, else a new request of the same shape (one the
        # upstream answers, after a failing one)
        spent = ledger.spent()
        retry = await gw.request(body(shape, n) if keyed else body(NEXT.get(shape, shape), next(_n)), headers=headers)
        assert retry.status == 200 and retry.complete, (answer, row, retry)
        await check_quiet(gw)
        if key is not None:
            replayed = retry.headers.get("x-tiergate-idempotent-replay") == "true"
            assert replayed == (row is not None and row.status == "ok"), (answer, row, retry)  # billed once
            if replayed:
                assert ledger.spent() == spent
        gc.collect()  # a task's exception nobody retrieved is reported as it is collected
        assert gw.loop_errors == [], gw.loop_errors
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == [], caplog.text
        if not answer.fired:
            return k - 1, seen
        if k >= MAX_STEPS:
            return k, seen


NEXT = {"fail500": "plain", "fail500-stream": "plain-stream", "failmid": "plain", "failmid-stream": "plain-stream"}
SHAPES = ["plain", "plain-stream", "miss", "miss-stream", "hit", "hit-stream", "hit-store", "hit-stream-store",
          "key", "key-stream",
          "plain-stream-slow", "key-stream-slow", "fail500", "fail500-stream", "failmid", "failmid-stream"]


@pytest.mark.parametrize("fault", ["cancel", "late", "disconnect"])
@pytest.mark.parametrize("shape", SHAPES)
async def test_a_request_stopped_at_any_step_settles_once(gw: InProcessGateway, shape: str, fault: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    steps, seen = await sweep(gw, shape, fault, caplog)
    print(f"{shape} {fault}: {steps} steps swept, rows of the stopped requests: {seen}")
    assert steps >= 4
    # stopped before anything was billed, and after (a hit is answered and billed within its first few steps)
    assert None in seen and len(seen) >= 2, seen
