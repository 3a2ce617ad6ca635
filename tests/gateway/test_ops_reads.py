"""/admin/ops reads numbers, not rows: the window's count, 5xx and latency percentiles are ranked in SQL
(`LedgerReads.latencies`, both ledgers), the hour's refusals summed there, and polls that come while one reads
share its read.

It read every row of the last five minutes into the gateway on asyncio's default threads, one read a poll, and
sorted them on the event loop: 200k rows, 2-4 s of the interpreter a poll, the loop's lag at 215 ms."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from quotas.ledger_rows import Refusal
from tests.conftest import Gateway
from tests.postgres import LedgerStore
from tests.quotas.test_ledger import row

MSG = [{"role": "user", "content": "hello there"}]
QUANTILES = (0.0, 0.5, 0.9, 0.95)


def nearest_rank(values: list[float], q: float) -> float | None:
    """What /admin/ops showed before: of the values in order, the one at rank int(q * n) from 0."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


@pytest.mark.parametrize("n", [0, 1, 2, 7, 20, 301])
def test_the_window_is_counted_and_ranked_by_the_database(ledger_store: LedgerStore, n: int) -> None:
    rand = random.Random(n)
    rows = [replace(row(i), ts=1000.0 + rand.uniform(-50, 100), http_status=rand.choice((200, 200, 429, 500, 503)),
                    ttft_s=None if i % 4 == 1 else round(rand.uniform(0, 3), 2),  # repeats: ties
                    total_s=round(rand.uniform(0, 9), 3)) for i in range(n)]
    ledger = ledger_store.open()
    ledger.record_now(rows)
    got = ledger.latencies(since=1000.0, quantiles=QUANTILES)
    ledger.close()
    window = [r for r in rows if r.ts >= 1000.0]
    assert got.requests == len(window)
    assert got.errors == sum(r.http_status >= 500 for r in window)
    assert got.ttft_s == {q: nearest_rank([r.ttft_s for r in window if r.ttft_s is not None], q) for q in QUANTILES}
    assert got.total_s == {q: nearest_rank([r.total_s for r in window], q) for q in QUANTILES}


def test_refusals_are_summed_per_reason_by_the_database(ledger_store: LedgerStore) -> None:
    refusals = [Refusal(request_id="r", ts=60.0 * m + 1, tenant=t, key_id=k, reason=reason, http_status=429)
                for m in range(10) for t in ("acme", "globex") for k in ("k1", "k2")
                for reason in ("rpm", "tpm", "budget")[:1 + m % 3]]
    ledger = ledger_store.open()
    ledger.record_now([], refusals)
    got = ledger.refusals_by_reason(since=180.0)
    ledger.close()
    assert got == dict(Counter(r.reason for r in refusals if r.ts >= 180.0))


def test_ops_reads_no_row_into_the_gateway(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for model in ("full", "mid", "full"):
            assert c.post("/v1/chat/completions", json={"model": model, "messages": MSG}).status_code == 200
    ledger = gateway.app.state.services.ledger
    rows = ledger.rows()

    def read_rows(**_: Any) -> Any:
        raise AssertionError("/admin/ops read the ledger's rows into the gateway")

    ledger.rows = ledger.each_row = read_rows
    with gateway.client(gateway.admin_key) as c:
        r = c.get("/admin/ops")
    assert r.status_code == 200, r.text
    ops = r.json()
    assert ops["requests"] == 3 and ops["error_rate"] == 0.0
    ttft = [x.ttft_s for x in rows if x.ttft_s is not None]
    assert ops["latency"] == {"ttft_p50_s": nearest_rank(ttft, 0.5), "ttft_p95_s": nearest_rank(ttft, 0.95),
                              "total_p50_s": nearest_rank([x.total_s for x in rows], 0.5),
                              "total_p95_s": nearest_rank([x.total_s for x in rows], 0.95)}


def test_polls_that_come_while_one_reads_share_its_read(gateway: Gateway) -> None:
    services = gateway.app.state.services
    ledger, reports = services.ledger, services.reports
    arrived, reads, go = 0, 0, threading.Event()
    read = reports.read

    async def arriving(reading: Any) -> Any:  # every poll comes here with its read, the code before's too
        nonlocal arrived
        arrived += 1
        return await read(reading)

    def held(real: Any) -> Any:
        def reading(**kwargs: Any) -> Any:
            nonlocal reads
            reads += 1
            go.wait(10)
            return real(**kwargs)
        return reading

    reports.read = arriving
    ledger.rows, ledger.latencies = held(ledger.rows), held(ledger.latencies)  # whichever the route reads
    with ThreadPoolExecutor(5) as pool:
        def poll() -> Any:
            with gateway.client(gateway.admin_key) as c:
                return c.get("/admin/ops")

        polls = [pool.submit(poll) for _ in range(5)]
        deadline = time.monotonic() + 10
        while arrived < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arrived == 5
        go.set()
        answers = [p.result() for p in polls]
    assert [a.status_code for a in answers] == [200] * 5
    assert reads == 1, f"{reads} reads of the ledger for 5 polls at once"
