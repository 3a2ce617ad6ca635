"""What the usage ledger stores: one row per finished request, refusal counts, and their SQLite schema.

quotas/ledger.py writes and reads them; these are the shapes and the SQL that maps them to tables. The schema is
run on every open (`IF NOT EXISTS`), so an index added here is built in a ledger from before at its first open
(refusal_counts_tenant_minute: a tenant's refusal counts without reading every tenant's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from decimal import Decimal
from operator import attrgetter
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    tier TEXT,
    model TEXT,
    status TEXT NOT NULL,
    http_status INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    price_usd TEXT NOT NULL,
    compute_cost_usd TEXT NOT NULL,
    cost_basis TEXT NOT NULL,
    ttft_s REAL,
    total_s REAL NOT NULL,
    finish_reason TEXT,
    error_code TEXT,
    route_reason TEXT,
    degrade_level INTEGER NOT NULL DEFAULT 0,
    degrade_actions TEXT,
    requested_tier TEXT,
    route_saving_usd TEXT NOT NULL DEFAULT '0',
    cache_status TEXT,
    cache_saving_usd TEXT NOT NULL DEFAULT '0',
    cascade_of TEXT,
    model_version TEXT,
    fallback TEXT
);
CREATE TABLE IF NOT EXISTS refusal_counts (
    minute INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    http_status INTEGER NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (minute, tenant, key_id, reason, http_status)
);
CREATE INDEX IF NOT EXISTS requests_tenant_ts ON requests(tenant, ts);
CREATE INDEX IF NOT EXISTS requests_ts ON requests(ts);
CREATE INDEX IF NOT EXISTS refusal_counts_tenant_minute ON refusal_counts(tenant, minute);
"""
# rows settled on a quota fallback: which of them Redis' counters have (quotas/backends/failover.py), and an index to
# find the others (run once `requests` has its `fallback` column: a ledger of an older release gains it first)
FALLBACK_SCHEMA = """
CREATE TABLE IF NOT EXISTS fallback_applied (request_id TEXT PRIMARY KEY);
CREATE INDEX IF NOT EXISTS requests_fallback ON requests(ts) WHERE fallback IS NOT NULL;
"""
# The rows whose money Redis' counters do not have yet, by arrival: what every reaper round reads, so its read follows
# the rows still pending, not every row of the last weeks that was applied. Triggers keep it, in the commit that
# writes a marked row and the one that notes it applied (`fallback_applied`, still written), so every writer keeps it,
# a replica of the release before too, during a rolling upgrade. SQLite's; PostgreSQL's: quotas/ledger_postgres.py.
FALLBACK_PENDING = (
    "CREATE TABLE fallback_pending (request_id TEXT PRIMARY KEY, ts REAL NOT NULL)",
    "CREATE INDEX fallback_pending_ts ON fallback_pending(ts)",
    """CREATE TRIGGER fallback_marked AFTER INSERT ON requests WHEN new.fallback IS NOT NULL BEGIN
        INSERT OR IGNORE INTO fallback_pending VALUES (new.request_id, new.ts);
    END""",
    """CREATE TRIGGER fallback_noted AFTER INSERT ON fallback_applied BEGIN
        DELETE FROM fallback_pending WHERE request_id = new.request_id;
    END""",
)
# a ledger from before the list: its marked rows not noted applied are pending (once, with the list's creation)
CARRY_PENDING = ("INSERT INTO fallback_pending SELECT request_id, ts FROM requests r WHERE fallback IS NOT NULL "
                 "AND NOT EXISTS (SELECT 1 FROM fallback_applied a WHERE a.request_id = r.request_id)")


@dataclass
class LedgerRow:
    request_id: str
    ts: float  # arrival, seconds since the epoch
    tenant: str
    key_id: str
    tier: str | None
    model: str | None
    status: str  # ok | error | cancelled
    http_status: int
    input_tokens: int
    output_tokens: int
    price_usd: Decimal
    compute_cost_usd: Decimal
    cost_basis: str  # engine: busy time the engine reported; wall: upstream time; none: no compute
    ttft_s: float | None
    total_s: float
    finish_reason: str | None = None
    error_code: str | None = None
    route_reason: str | None = None
    degrade_level: int = 0  # the degradation level in force when it was admitted
    degrade_actions: str | None = None  # what that level changed about it
    requested_tier: str | None = None  # what the request named (the plan default for `auto`)
    route_saving_usd: Decimal = Decimal(0)  # the requested tier's price minus what was charged, when cheaper
    cache_status: str | None = None  # hit | miss | bypass
    cache_saving_usd: Decimal = Decimal(0)  # for a hit: what the tier would have charged minus the hit price
    cascade_of: str | None = None  # a cascade's second attempt: the request id of the cheaper first attempt
    model_version: str | None = None  # the tier's version that answered (tiers with `versions`; else None)
    # settled on a replica's quota fallback during a Redis outage: the money still to reach Redis' counters
    # (quotas/backends/failover.py, `fallback_mark`); None for a row whose quota Redis settled
    fallback: str | None = None


@dataclass
class Refusal:
    """A request refused at admission (rate limit, budget, overload, shed): nothing spent, but counted."""

    request_id: str
    ts: float
    tenant: str
    key_id: str
    reason: str
    http_status: int


@dataclass(frozen=True)
class RefusalCount:
    """The refusals of one minute that share tenant, key, reason and status."""

    minute: int  # the minute's start, seconds since the epoch
    tenant: str
    key_id: str
    reason: str
    http_status: int
    count: int


@dataclass
class RequestTotals:
    """The sums of the requests of one report group (quotas/report.py), read in SQL or summed where they are read."""

    group: tuple[Any, ...]  # the values of the report's groups, in its order; a day as its first second (UTC)
    requests: int
    input_tokens: int
    output_tokens: int
    cache_hits: int
    price_usd: Decimal
    compute_cost_usd: Decimal
    cache_saving_usd: Decimal
    route_saving_usd: Decimal
    routed_down: int  # requests with a routing saving


@dataclass(frozen=True)
class RefusalTotal:
    """The refusals of one UTC day that share tenant, key and reason (all statuses)."""

    day: int  # the day's first second, seconds since the epoch
    tenant: str
    key_id: str
    reason: str
    count: int
    first_minute: int  # the earliest minute counted: a report lists reasons in the order they first occurred


COLUMNS = [f.name for f in fields(LedgerRow)]
COUNT_COLUMNS = [f.name for f in fields(RefusalCount)]
INSERT = f"INSERT INTO requests({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"
UPSERT_COUNT = ("INSERT INTO refusal_counts VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE "
                 "SET count = count + excluded.count")
FOLD_OLD_REFUSALS = ("INSERT INTO refusal_counts SELECT CAST(ts / 60 AS INTEGER) * 60, tenant, key_id, reason, "
                      "http_status, COUNT(*) FROM refusals WHERE true GROUP BY 1, 2, 3, 4, 5 "
                      "ON CONFLICT DO UPDATE SET count = count + excluded.count")
CountKey = tuple[int, str, str, str, int]  # minute, tenant, key_id, reason, http_status


_VALUES = attrgetter(*COLUMNS)


def to_db(row: LedgerRow) -> tuple[Any, ...]:
    """The row's values in COLUMNS' order, money as text (attribute reads: `asdict` deep-copies, 20x slower, and
    this runs on the event loop for every request; read in one `attrgetter` call, a third cheaper than one
    `getattr` each)."""
    return tuple([str(v) if isinstance(v, Decimal) else v for v in _VALUES(row)])


def from_db(values: Iterable[Any]) -> LedgerRow:
    row = LedgerRow(*values)
    for name in ("price_usd", "compute_cost_usd", "route_saving_usd", "cache_saving_usd"):
        setattr(row, name, Decimal(getattr(row, name)))
    return row


def count_key(refusal: Refusal) -> CountKey:
    return int(refusal.ts // 60) * 60, refusal.tenant, refusal.key_id, refusal.reason, refusal.http_status
