"""Usage and cost reports from the ledger, for finance: by tenant, tier and day, money in exact decimals.

A report reads totals, not rows (quotas/ledger_reads.py): the requests' sums per group and the refusal counts'
per day, tenant, key and reason, taken in SQL where they are exact there. The gateway runs reports in a process
of their own (`report_at`, quotas/report_worker.py), so summing a tenant's history never holds the gateway's
interpreter; the CLI runs them where it is. A report process keeps the sums of closed days (quotas/report_rollups.py):
asked again, a long report sums only its open days' rows and checks the kept ones in the indexes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from contextlib import suppress
from decimal import Decimal, localcontext
from typing import Any

from quotas.ledger_reads import EXACT, REPORT_GROUPS, LedgerReads, Reader, ReadSource, open_reader, store_identity
from quotas.money import round_cost
from quotas.report_rollups import DayRollups

log = logging.getLogger("tiergate.report")
GROUPS = REPORT_GROUPS
MONEY = ("price_usd", "compute_cost_usd", "margin_usd", "price_per_1k_usd", "cost_per_1k_usd",
         "cache_savings_usd", "routing_savings_usd")
COLUMNS = ("requests", "input_tokens", "output_tokens", "price_usd", "compute_cost_usd", "margin_usd",
           "price_per_1k_usd", "cost_per_1k_usd", "cache_hits", "cache_savings_usd", "routed_down",
           "routing_savings_usd", "refusals")
PER_1K_PLACES = Decimal("1e-9")


def day_of(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def usage_report(ledger: LedgerReads, *, by: tuple[str, ...] = ("tenant", "tier"), since: float | None = None,
                 until: float | None = None, tenant: str | None = None,
                 rollups: tuple[DayRollups, ReadSource, Any] | None = None) -> list[dict[str, Any]]:
    """One row per group: requests, tokens, price, compute cost, margin, per-1K figures, savings, refusals.

    Refusals have no tier (they never reached one); they are counted in the groups their other keys name,
    by the minute they fell in (`since` and `until` select whole minutes). With `rollups` (kept day sums, the
    ledger's source and its identity), the closed days' sums come from there (the same report).
    """
    unknown = [g for g in by if g not in GROUPS]
    if unknown:
        raise ValueError(f"cannot group by {unknown}; choose from {', '.join(GROUPS)}")
    twice = sorted(g for g, n in Counter(by).items() if n > 1)
    if twice:  # gateway/report_params.py refuses them first; a caller that skips it (a column per mention) stops here
        raise ValueError(f"groups are named once each; got {', '.join(twice)} more than once")
    if rollups is None:
        request_totals = ledger.request_totals(by, tenant=tenant, since=since, until=until)
        refusal_totals = ledger.refusal_totals(tenant=tenant, since=since, until=until)
    else:
        kept, source, identity = rollups
        request_totals, refusal_totals = kept.totals(ledger, source, identity, by, tenant=tenant, since=since,
                                                     until=until)
    groups: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(_empty)
    with localcontext(EXACT):  # sums of money, never rounded
        for t in request_totals:  # one per group and day or range read, summed
            g = groups[tuple(day_of(v) if name == "day" else v for name, v in zip(by, t.group, strict=True))]
            g["requests"] += t.requests
            g["input_tokens"] += t.input_tokens
            g["output_tokens"] += t.output_tokens
            g["price_usd"] += t.price_usd
            g["compute_cost_usd"] += t.compute_cost_usd
            g["cache_hits"] += t.cache_hits
            g["cache_savings_usd"] += t.cache_saving_usd
            g["routed_down"] += t.routed_down
            g["routing_savings_usd"] += t.route_saving_usd
    # per day, tenant, key and reason, in the order each reason first occurred (a group's reasons are listed so)
    for counted in refusal_totals:
        refusals = groups[_key(by, counted.tenant, None, counted.day, counted.key_id)]["refusals"]
        refusals[counted.reason] = refusals.get(counted.reason, 0) + counted.count
    out = []
    for key, g in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        tokens = g["input_tokens"] + g["output_tokens"]
        g["compute_cost_usd"] = round_cost(g["compute_cost_usd"])  # rows written before costs were rounded
        with localcontext(EXACT):
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


# a report process's connections, one per ledger it was asked about, with the identity of the database it opened
_readers: dict[ReadSource, tuple[Reader, Any]] = {}
ROLLUPS = DayRollups()  # the closed days' sums a report process keeps


def report_at(source: ReadSource, **query: Any) -> list[dict[str, Any]]:
    """`usage_report` on a read-only reader of the ledger at `source`, kept open for the next report, with the closed
    days' sums kept from the reports before (in a report process, quotas/report_worker.py). A reader that fails is
    closed; one kept from before is tried once more on a new connection (the database restarted meanwhile). A
    SQLite file replaced since its reader opened it (a reset, a restore) is opened again: the old one is not read."""
    for attempt in (1, 2):
        reader, identity = _readers.get(source, (None, None))
        if reader is not None and source.kind == "sqlite" and _file_changed(source, identity):
            del _readers[source]
            with suppress(Exception):
                reader.close()
            reader = None
        kept = reader is not None
        if reader is None:
            reader, identity = _readers[source] = _open(source)
        try:
            return usage_report(reader, rollups=(ROLLUPS, source, identity), **query)
        except ValueError:
            raise  # the query's own fault (an unknown group), not the connection's
        except Exception as exc:
            del _readers[source]
            with suppress(Exception):  # it failed already: its first error is the one that matters
                reader.close()
            if not kept or attempt == 2:
                raise
            log.warning("usage report: reading the ledger failed (%s); trying once more on a new connection", exc)
    raise AssertionError("unreachable")


def _open(source: ReadSource) -> tuple[Reader, Any]:
    """A reader and the identity of the database it reads (a file's taken first: if the file is replaced meanwhile,
    the next report sees it changed, never the other way round)."""
    identity = store_identity(source, None) if source.kind == "sqlite" else None
    reader = open_reader(source)
    if identity is None:
        try:
            identity = store_identity(source, reader)
        except Exception:
            reader.close()
            raise
    return reader, identity


def _file_changed(source: ReadSource, identity: Any) -> bool:
    try:
        return store_identity(source, None) != identity  # a file's: no query
    except OSError:
        return True


def jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Money as strings (exact), in plain digits as the CSV and the CLI write it ("0.00000006", never str()'s
    "6E-8", which a spreadsheet or a script that parses a decimal without exponents misreads); the rest as is."""
    return [{k: format(v, "f") if isinstance(v, Decimal) else v for k, v in r.items()} for r in rows]
