"""Reports read totals, not rows: the same report as summing every row, exact money, and a tenant's refusal counts
found by their own index and summed in SQL (SQLite and PostgreSQL).

A key can make ~21 refusal-count rows a minute for free (one per distinct invalid body), kept 90 days: read and
summed one by one in the gateway, 1M of them made that tenant's `/v1/usage` take 5.5 s and ~500 MiB, and with no
index on the tenant every tenant's report read them too.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections import defaultdict
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from quotas.ledger import Ledger, LedgerRow, Refusal
from quotas.money import round_cost
from quotas.report import COLUMNS, GROUPS, PER_1K_PLACES, day_of, jsonable, usage_report
from tests.postgres import LedgerStore

DAY = 1_800_057_600.0  # a UTC midnight
MONEY = ["0.000123", "1E-7", "0E-10", "0", "12.5", "0.00000000000000000001", "3.14159265358979", "0.0010"]


def mixed_rows() -> list[LedgerRow]:
    """Three tenants, keys, tiers (and none), cache hits, routing savings, money written every way Decimal writes
    it, over four days, with rows on either side of midnight and before 1970."""
    rows = []
    times = [DAY + i * 5_111.7 for i in range(80)] + [DAY + 86400, DAY + 86400 - 1e-6, DAY - 0.5, 0.5, -0.5, -86400.0]
    for i, ts in enumerate(times):
        rows.append(LedgerRow(
            f"r{i:03d}", ts, ["acme", "globex", "initech"][i % 3], f"k{i % 4}", [None, "mid", "full"][i % 3 if i % 7
                                                                                                    else 0],
            "m", "ok" if i % 5 else "error", 200, 10 * i, i % 17, Decimal(MONEY[i % len(MONEY)]),
            Decimal(MONEY[(i * 3) % len(MONEY)]), "engine", 0.1, 0.2,
            route_saving_usd=Decimal(MONEY[(i * 5) % len(MONEY)]) if i % 4 == 1 else Decimal(0),
            cache_status=["hit", "miss", None][i % 3] if i % 2 else "hit",
            cache_saving_usd=Decimal(MONEY[(i * 7) % len(MONEY)]) if i % 2 else Decimal("0.0002")))
    return rows


def mixed_refusals() -> list[Refusal]:
    reasons = ["rate_limit_rpm", "invalid_json", "missing", "insufficient_quota", "string_type"]
    out = []
    for i in range(300):
        ts = DAY - 3600 + i * 997.3
        out.append(Refusal(f"x{i}", ts, ["acme", "globex"][i % 2 if i % 11 else 0], f"k{i % 3}",
                           reasons[(i * 7) % len(reasons)], [429, 400][i % 2]))
        if i % 13 == 0:  # several reasons and statuses in one minute
            out += [Refusal(f"y{i}-{j}", ts + j, "acme", "k1", reasons[j], 400 + j) for j in range(5)]
    return out


def report_by_summing_rows(ledger: Ledger, *, by: tuple[str, ...], since: float | None = None,
                           until: float | None = None, tenant: str | None = None) -> list[dict[str, Any]]:
    """The report as it was made before it read totals: every request row and every minute's refusal count read
    and summed here (the minutes in the order the refusal_counts table's key sorts them)."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(lambda: {
        "requests": 0, "input_tokens": 0, "output_tokens": 0, "price_usd": Decimal(0), "compute_cost_usd": Decimal(0),
        "cache_hits": 0, "cache_savings_usd": Decimal(0), "routed_down": 0, "routing_savings_usd": Decimal(0),
        "refusals": {}})

    def key(tenant_: str, tier: str | None, ts: float, key_id: str) -> tuple[Any, ...]:
        values = {"tenant": tenant_, "tier": tier, "day": day_of(ts), "key_id": key_id}
        return tuple(values[g] for g in by)

    for row in ledger.each_row(tenant=tenant, since=since, until=until):
        g = groups[key(row.tenant, row.tier, row.ts, row.key_id)]
        g["requests"] += 1
        g["input_tokens"] += row.input_tokens
        g["output_tokens"] += row.output_tokens
        g["price_usd"] += row.price_usd
        g["compute_cost_usd"] += row.compute_cost_usd
        g["cache_hits"] += row.cache_status == "hit"
        g["cache_savings_usd"] += row.cache_saving_usd
        g["routed_down"] += row.route_saving_usd > 0
        g["routing_savings_usd"] += row.route_saving_usd
    counts = sorted(ledger.refusal_counts(tenant=tenant, since=since, until=until),
                    key=lambda c: (c.minute, c.tenant, c.key_id, c.reason, c.http_status))
    for counted in counts:
        refusals = groups[key(counted.tenant, None, counted.minute, counted.key_id)]["refusals"]
        refusals[counted.reason] = refusals.get(counted.reason, 0) + counted.count
    out = []
    for k, g in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        tokens = g["input_tokens"] + g["output_tokens"]
        g["compute_cost_usd"] = round_cost(g["compute_cost_usd"])  # a report's cost sum to the picodollar
        g["margin_usd"] = g["price_usd"] - g["compute_cost_usd"]
        g["price_per_1k_usd"] = (g["price_usd"] * 1000 / tokens).quantize(PER_1K_PLACES) if tokens else Decimal(0)
        g["cost_per_1k_usd"] = (g["compute_cost_usd"] * 1000 / tokens).quantize(PER_1K_PLACES) if tokens else Decimal(0)
        out.append(dict(zip(by, k, strict=True)) | {c: g[c] for c in COLUMNS})
    return out


def test_a_report_is_the_one_summing_every_row_made(ledger_store: LedgerStore) -> None:
    """Every grouping, with and without dates (whole minutes for refusals, bounds inside a minute) and a tenant:
    the same rows, values, decimal places and order of reasons, as the JSON a client gets."""
    ledger = ledger_store.open()
    ledger.record_now(mixed_rows(), refusals=mixed_refusals())
    groupings = [combo for n in range(1, 5) for combo in itertools.combinations(GROUPS, n)]
    groupings += [("day", "tenant"), ("key_id", "tier", "day", "tenant")]
    with pytest.raises(ValueError, match="more than once"):  # a group named twice adds only a column to compute
        usage_report(ledger, by=("tenant", "tenant"))
    ranges = [(None, None), (DAY, None), (None, DAY + 2 * 86400), (DAY + 30.5, DAY + 86400 + 90.25)]
    compared = 0
    for by, (since, until), tenant in itertools.product(groupings, ranges, (None, "acme")):
        new = usage_report(ledger, by=by, since=since, until=until, tenant=tenant)
        old = report_by_summing_rows(ledger, by=by, since=since, until=until, tenant=tenant)
        assert json.dumps(jsonable(new)) == json.dumps(jsonable(old)), (by, since, until, tenant)
        compared += bool(new)
    assert compared == len(groupings) * len(ranges) * 2  # none of them empty
    ledger.close()


def test_money_sums_are_exact_past_28_digits(ledger_store: LedgerStore) -> None:
    """Sums are exact however many digits they take (Python's default context keeps 28: summed one by one, these
    lost their last digits)."""
    ledger = ledger_store.open()
    prices = ["0.1234567890123456789012345678"] * 3 + ["12.5"]
    ledger.record_now([LedgerRow(f"r{i}", DAY + i, "acme", "k", "mid", "m", "ok", 200, 1, 1, Decimal(price),
                                 Decimal("0.0000000001"), "engine", 0.1, 0.2) for i, price in enumerate(prices)])
    (acme,) = usage_report(ledger, by=("tenant",))
    assert str(acme["price_usd"]) == "12.8703703670370370367037037034"  # 30 digits
    assert str(acme["margin_usd"]) == "12.8703703666370370367037037034"
    ledger.close()


def refusal_reads(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...], int]]:
    """The reads of refusal_counts the ledger makes from now on: their SQL, arguments and rows returned."""
    reads: list[tuple[str, tuple[Any, ...], int]] = []
    query = ledger._query

    def counted(sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        rows = query(sql, args)
        if "refusal_counts" in sql:
            reads.append((sql, args, len(rows)))
        return rows

    monkeypatch.setattr(ledger, "_query", counted)
    return reads


def plan(ledger_store: LedgerStore, sql: str, args: tuple[Any, ...]) -> str:
    """How the database runs `sql` (PostgreSQL told to use an index where it has one: these tables are small)."""
    if ledger_store.kind == "sqlite":
        with sqlite3.connect(ledger_store.target) as conn:
            return "\n".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args))
    with psycopg.connect(ledger_store.target, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        return "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.replace("?", "%s"), args))


def test_a_tenants_refusal_counts_are_found_by_their_index_and_summed_in_sql(ledger_store: LedgerStore,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Three days of a minute-by-minute flood of two reasons (864 rows) and another tenant's: the report reads one
    row per day and reason, found by (tenant, minute), not every tenant's minutes."""
    ledger = ledger_store.open()
    flood = [Refusal(f"m{i}", DAY + i * 300, "mallory", "k1", ["invalid_json", "missing"][i % 2], 400)
             for i in range(864)]
    ledger.record_now([], refusals=[*flood, *(Refusal(f"a{i}", DAY + i * 60, "acme", "k", "rate_limit_rpm", 429)
                                              for i in range(50))])
    reads = refusal_reads(ledger, monkeypatch)
    (mallory,) = usage_report(ledger, by=("tenant",), tenant="mallory")
    assert mallory["refusals"] == {"invalid_json": 432, "missing": 432}
    by_day = usage_report(ledger, by=("tenant", "day"), tenant="mallory", since=DAY + 86400)
    assert [(r["day"], sum(r["refusals"].values())) for r in by_day] == [(day_of(DAY + 86400), 288),
                                                                          (day_of(DAY + 2 * 86400), 288)]
    assert len(reads) == 2 and [n for _, _, n in reads] == [3 * 2, 2 * 2]
    for sql, args, _ in reads:
        assert "refusal_counts_tenant_minute" in plan(ledger_store, sql, args), sql
    ledger.close()


def test_a_ledger_from_before_gets_the_index_when_opened(tmp_path: Any) -> None:
    db = tmp_path / "ledger.db"
    Ledger(db).close()
    with sqlite3.connect(db) as conn:  # as the release before left it
        conn.execute("DROP INDEX IF EXISTS refusal_counts_tenant_minute")
    ledger = Ledger(db)
    ledger.close()
    with sqlite3.connect(db) as conn:
        indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "refusal_counts_tenant_minute" in indexes
