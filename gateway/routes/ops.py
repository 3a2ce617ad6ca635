"""GET /admin/ops: the on-call snapshot the dashboard polls: latency, queues, refusals, tiers, the ladder.

The window's count, 5xx and latency percentiles are the database's to compute (`LedgerReads.latencies`), and
the hour's refusals its to sum: the gateway reads a handful of numbers, on a thread of its own, one read at a
time however many tabs poll (gateway/one_flight.py). It read every row of the window into Python on asyncio's
default threads and sorted them on the event loop: 200k rows (~670 req/s), 2-4 s of the interpreter a poll and
the loop's lag at 215 ms, every 5 s per open tab.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import get
from litestar.di import NamedDependency

from gateway.ladder.controller import LadderController
from gateway.one_flight import OneFlight
from gateway.report_gate import ReportGate
from gateway.routes.guarded import admin_only
from gateway.routes.openapi import BEARER, errors
from quotas.dispatch import TierQueue
from quotas.ledger import Ledger
from tiers.fleet import Fleet

WINDOW_S = 300.0  # latency and errors over the last five minutes; refusals over the last hour
QUANTILES = (0.5, 0.95)
_READS = OneFlight("tiergate-ops")


@get("/admin/ops", tags=["admin"], security=BEARER,
     responses=errors(400, 401, 403, 500, 503))
async def ops(ledger: NamedDependency[Ledger], queues: NamedDependency[dict[str, TierQueue]],
              fleet: NamedDependency[Fleet], ladder: NamedDependency[LadderController],
              reports: NamedDependency[ReportGate]) -> dict[str, Any]:
    now = time.time()
    # a ledger that cannot be read now (locked, its database down, a read past its statement timeout) is a 503
    latency, refusals = await reports.read(_READS.run(ledger, lambda: (
        ledger.latencies(since=now - WINDOW_S, quantiles=QUANTILES), ledger.refusals_by_reason(since=now - 3600))))
    return {
        "window_s": WINDOW_S,
        "requests": latency.requests,
        "error_rate": latency.errors / latency.requests if latency.requests else 0.0,
        "latency": {"ttft_p50_s": latency.ttft_s[0.5], "ttft_p95_s": latency.ttft_s[0.95],
                    "total_p50_s": latency.total_s[0.5], "total_p95_s": latency.total_s[0.95]},
        "queues": {name: {"waiting": q.num_waiting, "in_flight": q.in_flight, "capacity": q.capacity}
                   for name, q in queues.items()},
        "refusals_last_hour": refusals,
        "tiers": fleet.status(),
        "degrade": ladder.status(),
    }


ops_router = admin_only(ops)
