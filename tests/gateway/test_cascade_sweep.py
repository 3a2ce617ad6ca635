"""A cascaded request (`auto` under a plan's cascade: `mid` answers empty, the check retries it on `full`) stopped at
every one of its suspension points in turn, as tests/gateway/test_cancel_sweep.py stops a plain one: its two
attempts, reserved, answered, settled and retried with the client's one concurrency slot and rpm place, each settle
exactly once whatever stops it (its handler cancelled while it waits, or as what it waited for ends, or its client
disconnecting). After each, once the gateway is quiet: nothing held (the gate, both tiers' queues, no reservation
open); each attempt's row, if any, priced at its own tier for its tokens; the quota store's spend moved by exactly
the rows' prices and its window holding each row's tokens; a whole answer billed as the retry's row says; nothing
logged as an error; and the tenant's next request, one at a time, answered."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from quotas.ledger import LedgerRow
from quotas.money import to_pico
from tests.conftest import stub_tiers_yaml
from tests.gateway.cancel_sweep import WORDS, InProcessGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLANS = """
default_plan: swept
plans:
  swept:
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {max_concurrent: 1, rpm: 100000, tpm: 10000000, budget_day_usd: "1000"}
    routing: {cascade: true, cascade_streams: true}
    cache: {enabled: false}
"""
_n = itertools.count()


def tiers(url: str) -> str:
    return stub_tiers_yaml(mid=url, full=url)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> AsyncIterator[InProcessGateway]:
    async with InProcessGateway(tmp_path_factory.mktemp("cascade-sweep"), prepared_models, plans=PLANS,
                                tiers_file=tiers) as gateway:
        yield gateway


def body(n: int, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "auto", "messages": [{"role": "user", "content": f"CASCADE question {n}"}],
                           "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def spent(gw: InProcessGateway) -> int:
    day = time.strftime("%Y%m%d", time.gmtime())
    return gw.services.quota_backend.spend_of("acme", "t", day, day[:6])[0]


def window_tokens(gw: InProcessGateway, request_id: str) -> int:
    scope = gw.services.quota_backend._state.get(("acme", "t"))
    return scope.tokens.get(request_id, 0) if scope is not None else 0


async def quiet(gw: InProcessGateway) -> None:
    await gw.quiesce()
    assert gw.last is not None
    assert all(t.done() for t in gw.last.tasks), [t for t in gw.last.tasks if not t.done()]
    gw.assert_nothing_held()


def check_rows(gw: InProcessGateway, rows: list[LedgerRow], whole: dict[str, Any] | None) -> None:
    for row in rows:
        tier = gw.services.catalogue.tiers[row.tier or ""]
        assert row.price_usd == tier.price(row.input_tokens, row.output_tokens), row
        assert row.output_tokens <= len(WORDS), row
        assert window_tokens(gw, row.request_id) == row.input_tokens + row.output_tokens, row
    if whole is not None:  # the client got the retry's whole answer: both attempts billed, the retry as it said
        first, second = rows
        assert (first.tier, second.tier, second.cascade_of) == ("mid", "full", first.request_id), rows
        assert first.status == second.status == "ok", rows
        assert second.output_tokens == whole["usage"]["completion_tokens"] == len(WORDS), rows


@pytest.mark.parametrize("fault", ["cancel", "late", "disconnect"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_cascaded_request_stopped_at_any_step_settles_each_attempt_once(
        gw: InProcessGateway, fault: str, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    k, seen = 0, set()
    while True:
        k += 1
        before = spent(gw)
        answer = await gw.request(body(next(_n), stream), at=k, fault=fault)
        await quiet(gw)
        rid = answer.request_id
        rows = [r for r in (gw.services.ledger.get(rid), gw.services.ledger.get(f"{rid}-cascade")) if r] if rid else []
        whole = answer.json() if not stream and answer.status == 200 and answer.complete else None
        check_rows(gw, rows, whole)
        assert spent(gw) - before == sum(to_pico(r.price_usd) for r in rows), (answer, rows)
        if answer.fired:
            seen.add(tuple(r.status for r in rows))
        after = await gw.request(body(next(_n), stream))
        assert after.status == 200 and after.complete, (answer, rows, after)
        await quiet(gw)
        gc.collect()
        assert gw.loop_errors == [], gw.loop_errors
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == [], caplog.text
        if not answer.fired:
            break
    print(f"stream={stream} {fault}: {k - 1} steps swept, rows of the stopped requests: {seen}")
    assert k > 4 and () in seen and len(seen) >= 2, seen
