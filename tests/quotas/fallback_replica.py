"""A gateway replica in a process of its own, for tests that kill it with SIGKILL: its quota backend built as the
gateway builds it (gateway/app.py `build_quota_backend`, Redis given by argv), it admits and settles requests as
the request pipeline does (the ledger row, marked as its reservation says, durable before the quota settle), says
SETTLED, and waits to be killed.

argv: ledger path, Redis url, tenant, number of requests, picodollars each."""

from __future__ import annotations

import asyncio
import sys
import time
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

from gateway.app import build_quota_backend
from gateway.settings import Settings
from quotas.backends.base import QuotaBackendError
from quotas.ledger import Ledger
from quotas.ledger_rows import LedgerRow
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.money import from_pico


async def main(path: str, url: str, tenant: str, n: int, pico: int) -> None:
    ledger = Ledger(Path(path))
    ledger.start()
    metrics = SimpleNamespace(redis_state=lambda up: None)
    backend = build_quota_backend(Settings(redis_url=url), ledger, metrics)  # type: ignore[arg-type]
    for i in range(n):
        req = ReservationRequest(f"{tenant}-dead-{i}", tenant, (ScopeLimits("t", budget_day_pico=10**9),), 10, pico,
                                 dated_at=time.time())
        for _ in range(500):  # the retryable 503s a frozen Redis gives before it counts as down
            try:
                decision = await backend.reserve(req)
                break
            except QuotaBackendError:
                await asyncio.sleep(0.02)
        assert decision.admitted
        row = LedgerRow(request_id=req.request_id, ts=req.dated_at or 0.0, tenant=tenant, key_id="k", tier="mid",
                        model="m", status="ok", http_status=200, input_tokens=5, output_tokens=5,
                        price_usd=from_pico(pico), compute_cost_usd=Decimal(0), cost_basis="none", ttft_s=None,
                        total_s=0.1)
        row.fallback = getattr(decision, "fallback", None)  # gateway/pipeline/settle.py's `row`
        await ledger.record(row)
        await backend.settle(req, tokens=10, money_pico=pico)
    print("SETTLED", backend.up, flush=True)  # type: ignore[attr-defined]
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
