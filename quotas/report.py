"""Usage and cost reports from the ledger, for finance: by tenant, tier and day, money in exact decimals."""

from __future__ import annotations

import time
from collections import defaultdict
from decimal import Decimal
from typing import Any

from quotas.ledger import Ledger

GROUPS = ("tenant", "tier", "day", "key_id")
MONEY = ("price_usd", "compute_cost_usd", "margin_usd", "price_per_1k_usd", "cost_per_1k_usd",
         "cache_savings_usd", "routing_savings_usd")
COLUMNS = ("requests", "input_tokens", "output_tokens", "price_usd", "compute_cost_usd", "margin_usd",
           "price_per_1k_usd", "cost_per_1k_usd", "cache_hits", "cache_savings_usd", "routed_down",
           "routing_savings_usd", "refusals")
PER_1K_PLACES = Decimal("1e-9")


def day_of(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def usage_report(ledger: Ledger, *, by: tuple[str, ...] = ("tenant", "tier"), since: float | None = None,
                 until: float | None = None, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per group: requests, tokens, price, compute cost, margin, per-1K figures, savings, refusals.

    Refusals have no tier (they never reached one); they are counted in the groups their other keys name,
    by the minute they fell in (`since` and `until` select whole minutes).
    """
    unknown = [g for g in by if g not in GROUPS]
    if unknown:
        raise ValueError(f"cannot group by {unknown}; choose from {', '.join(GROUPS)}")
    groups: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(_empty)
    for row in ledger.each_row(tenant=tenant, since=since, until=until):  # a batch at a time, not every row
        g = groups[_key(by, row.tenant, row.tier, row.ts, row.key_id)]
        g["requests"] += 1
        g["input_tokens"] += row.input_tokens
        g["output_tokens"] += row.output_tokens
        g["price_usd"] += row.price_usd
        g["compute_cost_usd"] += row.compute_cost_usd
        g["cache_hits"] += row.cache_status == "hit"
        g["cache_savings_usd"] += row.cache_saving_usd
        g["routed_down"] += row.route_saving_usd > 0
        g["routing_savings_usd"] += row.route_saving_usd
    for counted in ledger.refusal_counts(tenant=tenant, since=since, until=until):
        refusals = groups[_key(by, counted.tenant, None, counted.minute, counted.key_id)]["refusals"]
        refusals[counted.reason] = refusals.get(counted.reason, 0) + counted.count
    out = []
    for key, g in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        tokens = g["input_tokens"] + g["output_tokens"]
        g["margin_usd"] = g["price_usd"] - g["compute_cost_usd"]
        g["price_per_1k_usd"] = (g["price_usd"] * 1000 / tokens).quantize(PER_1K_PLACES) if tokens else Decimal(0)
        g["cost_per_1k_usd"] = (g["compute_cost_usd"] * 1000 / tokens).quantize(PER_1K_PLACES) if tokens else Decimal(0)
        out.append(dict(zip(by, key, strict=True)) | {c: g[c] for c in COLUMNS})
    return out


def _empty() -> dict[str, Any]:
    return {"requests": 0, "input_tokens": 0, "output_tokens": 0, "price_usd": Decimal(0),
            "compute_cost_usd": Decimal(0), "cache_hits": 0, "cache_savings_usd": Decimal(0), "routed_down": 0,
            "routing_savings_usd": Decimal(0), "refusals": {}}


def _key(by: tuple[str, ...], tenant: str, tier: str | None, ts: float, key_id: str) -> tuple[Any, ...]:
    values = {"tenant": tenant, "tier": tier, "day": day_of(ts), "key_id": key_id}
    return tuple(values[g] for g in by)


def jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Money as strings (exact), the rest as is."""
    return [{k: str(v) if isinstance(v, Decimal) else v for k, v in r.items()} for r in rows]
