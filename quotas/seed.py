"""Rebuild the embedded quota state from the durable ledger, so budgets and windows survive a restart."""

from __future__ import annotations

import calendar
import time

from quotas.backends.memory import MemoryBackend
from quotas.ledger import Ledger
from quotas.limits import WINDOW_S
from quotas.money import to_pico


def seed_from_ledger(memory: MemoryBackend, ledger: Ledger, now: float | None = None) -> int:
    """Load this month's spend, today's spend and the last minute's requests per tenant and key scope.

    Returns the number of ledger rows read.
    """
    now = time.time() if now is None else now
    t = time.gmtime(now)
    month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    day_start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    day, month = time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
    sums: dict[tuple[str, str], list[int]] = {}
    recent: dict[tuple[str, str], list[tuple[float, str, int]]] = {}
    rows = ledger.rows(since=month_start)
    for row in rows:
        for scope in ("t", f"k:{row.key_id}"):
            key = (row.tenant, scope)
            s = sums.setdefault(key, [0, 0])
            pico = to_pico(row.price_usd)
            s[1] += pico
            if row.ts >= day_start:
                s[0] += pico
            if row.ts > now - WINDOW_S:
                recent.setdefault(key, []).append((row.ts, row.request_id, row.input_tokens + row.output_tokens))
    for (tenant, scope), (spent_day, spent_month) in sums.items():
        memory.seed(tenant, scope, day=day, month=month, spent_day_pico=spent_day, spent_month_pico=spent_month,
                    recent=recent.get((tenant, scope), []))
    return len(rows)
