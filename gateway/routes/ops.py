"""GET /admin/ops: the on-call snapshot the dashboard polls: latency, queues, refusals, tiers, the ladder."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from litestar import Request, get

from gateway.auth import require_admin

WINDOW_S = 300.0  # latency and errors over the last five minutes; refusals over the last hour


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@get("/admin/ops", guards=[require_admin])
async def ops(request: Request[Any, Any, Any]) -> dict[str, Any]:
    services = request.app.state.services
    now = time.time()
    rows = services.ledger.rows(since=now - WINDOW_S)
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    total = [r.total_s for r in rows]
    refusals: Counter[str] = Counter()
    for count in services.ledger.refusal_counts(since=now - 3600):
        refusals[count.reason] += count.count
    return {
        "window_s": WINDOW_S,
        "requests": len(rows),
        "error_rate": sum(r.http_status >= 500 for r in rows) / len(rows) if rows else 0.0,
        "latency": {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
                    "total_p50_s": _pct(total, 0.5), "total_p95_s": _pct(total, 0.95)},
        "queues": {name: {"waiting": q.num_waiting, "in_flight": q.in_flight, "capacity": q.capacity}
                   for name, q in services.queues.items()},
        "refusals_last_hour": dict(refusals),
        "tiers": services.fleet.status(),
        "degrade": services.ladder.status(),
    }
