"""The usage ledger: one durable row per finished request, in SQLite (WAL) under the data directory.

Rows are written by one thread in grouped transactions: many requests share one commit (one fsync), and
each request's `record` returns only once its row is on disk, so a response the client has received is
never missing from the ledger, even if the gateway is killed right after.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from decimal import Decimal
from pathlib import Path
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
    cascade_of TEXT
);
CREATE TABLE IF NOT EXISTS refusals (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    http_status INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS refusals_ts ON refusals(ts);
CREATE INDEX IF NOT EXISTS requests_tenant_ts ON requests(tenant, ts);
CREATE INDEX IF NOT EXISTS requests_ts ON requests(ts);
"""
GROUP_MAX = 512  # rows per commit at most


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


@dataclass
class Refusal:
    """A request refused at admission (rate limit, budget, overload, shed): nothing spent, but counted."""

    request_id: str
    ts: float
    tenant: str
    key_id: str
    reason: str
    http_status: int


_COLUMNS = [f.name for f in fields(LedgerRow)]
_INSERT = f"INSERT INTO requests({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"


def _to_db(row: LedgerRow) -> tuple[Any, ...]:
    return tuple(str(v) if isinstance(v, Decimal) else v for v in asdict(row).values())


def _from_db(values: Iterable[Any]) -> LedgerRow:
    row = LedgerRow(*values)
    for name in ("price_usd", "compute_cost_usd", "route_saving_usd", "cache_saving_usd"):
        setattr(row, name, Decimal(getattr(row, name)))
    return row


_REFUSAL_COLUMNS = [f.name for f in fields(Refusal)]
_INSERT_REFUSAL = f"INSERT OR IGNORE INTO refusals VALUES ({', '.join('?' for _ in _REFUSAL_COLUMNS)})"


class Ledger:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._read = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._read.execute("PRAGMA journal_mode=WAL")
        self._read.executescript(SCHEMA)
        columns = {r[1] for r in self._read.execute("PRAGMA table_info(requests)")}
        for name, decl in (("degrade_level", "INTEGER NOT NULL DEFAULT 0"), ("degrade_actions", "TEXT"),
                           ("requested_tier", "TEXT"), ("route_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cache_status", "TEXT"), ("cache_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cascade_of", "TEXT")):
            if name not in columns:  # a ledger from before the degradation ladder
                self._read.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
        self._queue: queue.Queue[tuple[str, tuple[Any, ...], asyncio.Future[None] | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._writer, name="ledger-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self._read.close()

    async def record(self, row: LedgerRow) -> None:
        """Write `row`; returns once it is durable."""
        await asyncio.shield(self.submit(row))

    def submit(self, row: LedgerRow) -> asyncio.Future[None]:
        """Queue `row` for the next group commit; the future resolves once it is durable.

        Queuing is synchronous, so a row submitted by a task that is being cancelled is still written.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put((_INSERT, _to_db(row), fut))
        return fut

    def submit_refusal(self, refusal: Refusal) -> None:
        """Queue a refusal for the next group commit (nothing waits on it)."""
        self._queue.put((_INSERT_REFUSAL, tuple(asdict(refusal).values()), None))

    def record_now(self, rows: list[LedgerRow]) -> None:
        """Synchronous write, for tools and tests that run without an event loop."""
        with self._read:
            self._read.executemany(_INSERT, [_to_db(r) for r in rows])

    def _writer(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA synchronous=FULL")
        stop = False
        while not stop:
            item = self._queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= GROUP_MAX:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            stop = item is None
            if batch:
                self._commit(conn, batch)
        conn.close()

    def _commit(self, conn: sqlite3.Connection,
                batch: list[tuple[str, tuple[Any, ...], asyncio.Future[None] | None]]) -> None:
        error: Exception | None = None
        try:
            conn.execute("BEGIN IMMEDIATE")
            for sql, params, _ in batch:
                conn.execute(sql, params)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            conn.execute("ROLLBACK") if conn.in_transaction else None
            error = exc
        for _, _, fut in batch:
            if fut is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, fut, error)

    # ---- reads ----

    def rows(self, *, tenant: str | None = None, since: float | None = None,
             until: float | None = None) -> list[LedgerRow]:
        return [_from_db(r) for r in self._select("requests", _COLUMNS, tenant, since, until)]

    def refusals(self, *, tenant: str | None = None, since: float | None = None,
                 until: float | None = None) -> list[Refusal]:
        return [Refusal(*r) for r in self._select("refusals", _REFUSAL_COLUMNS, tenant, since, until)]

    def _select(self, table: str, columns: list[str], tenant: str | None, since: float | None,
                until: float | None) -> list[tuple[Any, ...]]:
        sql, args = f"SELECT {', '.join(columns)} FROM {table} WHERE 1=1", []
        for clause, value in (("tenant = ?", tenant), ("ts >= ?", since), ("ts < ?", until)):
            if value is not None:
                sql += f" AND {clause}"
                args.append(value)
        return self._read.execute(sql + " ORDER BY ts", args).fetchall()

    def get(self, request_id: str) -> LedgerRow | None:
        r = self._read.execute(f"SELECT {', '.join(_COLUMNS)} FROM requests WHERE request_id = ?",
                               (request_id,)).fetchone()
        return _from_db(r) if r else None


def _settle(fut: asyncio.Future[None], error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
