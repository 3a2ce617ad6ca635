"""GET /admin/ops: the on-call snapshot the dashboard polls: latency, queues, refusals, tiers, the ladder."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from litestar import get
from litestar.di import NamedDependency

from gateway.ladder.controller import LadderController
from gateway.report_gate import ReportGate
from gateway.routes.guarded import admin_only
from gateway.routes.openapi import BEARER, errors
from quotas.dispatch import TierQueue
from quotas.ledger import Ledger
from tiers.fleet import Fleet

WINDOW_S = 300.0  # latency and errors over the last five minutes; refusals over the last hour


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@get("/admin/ops", tags=["admin"], security=BEARER,
     responses=errors(400, 401, 403, 500, 503))
async def ops(ledger: NamedDependency[Ledger], queues: NamedDependency[dict[str, TierQueue]],
              fleet: NamedDependency[Fleet], ladder: NamedDependency[LadderController],
              reports: NamedDependency[ReportGate]) -> dict[str, Any]:
    now = time.time()
    # a ledger that cannot be read now (locked, its database down, a read past its statement timeout) is a 503
    rows, counts = await reports.read(asyncio.to_thread(
        lambda: (ledger.rows(since=now - WINDOW_S), ledger.refusal_counts(since=now - 3600))))
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    total = [r.total_s for r in rows]
    refusals: Counter[str] = Counter()
    for count in counts:
        refusals[count.reason] += count.count
    return {
        "window_s": WINDOW_S,
        "requests": len(rows),
        "error_rate": sum(r.http_status >= 500 for r in rows) / len(rows) if rows else 0.0,
        "latency": {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
                    "total_p50_s": _pct(total, 0.5), "total_p95_s": _pct(total, 0.95)},
        "queues": {name: {"waiting": q.num_waiting, "in_flight": q.in_flight, "capacity": q.capacity}
                   for name, q in queues.items()},
        "refusals_last_hour": dict(refusals),
        "tiers": fleet.status(),
        "degrade": ladder.status(),
    }


ops_router = admin_only(ops)
