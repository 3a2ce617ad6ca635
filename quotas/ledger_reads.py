"""The ledger's reads, shared by the ledgers (quotas/ledger.py) and by read-only readers of the same database.

A reader (`open_reader`) is what a usage report runs on in a process of its own (quotas/report_worker.py): it
opens its own connection to the database a ledger names (`Ledger.read_source()`: the SQLite file or the
PostgreSQL URL), reads and never writes, and has none of the ledger's writer.

A read the database cannot answer now (down, busy, locked, or cancelled at READ_TIMEOUT_S) is told from a bug by
`read_fault`: the gateway answers it with a retryable 503 (gateway/report_gate.py), never the driver's words.

Reports read totals, not rows: refusal counts summed in SQL per UTC day, tenant, key and reason (integers: exact
anywhere); request rows summed per report group, in SQL on PostgreSQL (NUMERIC money: exact sums) and where
they are read on SQLite (money is TEXT there: summed as exact decimals, never as floats).
"""

from __future__ import annotations

import math
import os
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal
from typing import Any, NamedTuple

import psycopg

from quotas.ledger_rows import (
    COLUMNS,
    COUNT_COLUMNS,
    LedgerRow,
    RefusalCount,
    RefusalTotal,
    RequestTotals,
    from_db,
)

SQLITE_ERROR = 1  # SQLite's primary result code for an SQL error (no such table, a syntax error): a bug, not a fault
READ_BATCH = 5000  # rows a streamed read (`each_row`) holds at once
# a read statement on PostgreSQL (a report's sum, the dashboard's rows, a streamed read's each batch) runs at most
# this long: one slower (a report over a huge range, a read waiting on an operator's LOCK TABLE) is cancelled
# (SQLSTATE 57014) rather than holding one of the ledger's few read connections, or a report process, without end
READ_TIMEOUT_S = 60.0
REPORT_GROUPS = ("tenant", "tier", "day", "key_id")
# additions and subtractions of money with no rounding (the default context keeps 28 digits): exact to the last
# digit, however many rows are summed. Not for division (a third has no end).
EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)


class Marks(NamedTuple):
    """What tells whether a range's rows changed, read without summing them (quotas/report_rollups.py): requests are
    never deleted or rewritten and refusal counts only grow, except the retention's pruning of the oldest minutes."""

    rows: int  # request rows
    refused: int  # refusals: the sum of the refusal-count rows' counts (a late one adds to a row already there)
    first_minute: int | None  # the earliest refusal minute (what the retention prunes first)


NO_MARKS = Marks(0, 0, None)


class Latencies(NamedTuple):
    """Requests of a window, those answered with a 5xx, and quantiles of their latencies (`LedgerReads.latencies`)."""

    requests: int
    errors: int  # http_status >= 500
    ttft_s: dict[float, float | None]  # quantile -> seconds to the first token, of the rows that have one
    total_s: dict[float, float | None]  # quantile -> seconds to the end


class ReadSource(NamedTuple):
    """Where a ledger's rows are, for a reader in another process: ("sqlite", path) or ("postgres", url)."""

    kind: str
    target: str


class LedgerReads(ABC):
    """The reads: rows, refusal counts, and the totals reports use. An implementation supplies `_query`,
    `_stream`, how to take a row's second and its day (`_TS_SECOND`, `_day_start`) and how to sum requests
    (`_sum_requests`)."""

    _TS_SECOND: str  # SQL: the whole second (floor) of a row's `ts`, as time.gmtime takes it

    @abstractmethod
    def _day_start(self, second: str) -> str:
        """SQL: the first second of the UTC day of the integer expression `second` (negative seconds too)."""

    @abstractmethod
    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """A read (`?` placeholders), on a connection of the caller's thread's choosing, not the writer's."""

    @abstractmethod
    def _stream(self, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
        """A read, as batches of at most `size` rows, fetched as they are taken (the caller's thread)."""

    @abstractmethod
    def _sum_requests(self, keys: list[str], where: str, args: tuple[Any, ...]) -> list[RequestTotals]:
        """One RequestTotals per distinct value of the SQL expressions `keys` among the requests `where` selects."""

    def rows(self, *, tenant: str | None = None, since: float | None = None,
             until: float | None = None) -> list[LedgerRow]:
        return list(self.each_row(tenant=tenant, since=since, until=until))

    def each_row(self, *, tenant: str | None = None, since: float | None = None,
                 until: float | None = None) -> Iterator[LedgerRow]:
        """The rows `rows` gives, in its order, read READ_BATCH at a time: a report over a busy tenant's year holds
        one batch in memory, not the year (a tenant's `/v1/usage` with no dates read every row it ever made into
        one list, in the gateway's process)."""
        sql, args = _select_sql("requests", COLUMNS, "ts", tenant, since, until)
        for batch in self._stream(sql, args, READ_BATCH):
            for r in batch:
                yield from_db(r)

    def refusal_counts(self, *, tenant: str | None = None, since: float | None = None,
                       until: float | None = None) -> list[RefusalCount]:
        """Counts per minute; `since` and `until` select whole minutes by their start."""
        return [RefusalCount(*r) for r in self._query(*_select_sql("refusal_counts", COUNT_COLUMNS, "minute", tenant,
                                                                   since, until))]

    def refusals_by_reason(self, *, since: float) -> dict[str, int]:
        """Refusals per reason in the minutes from `since` (by their start), summed in SQL: the dashboard's refusal
        chart reads a few totals, not every tenant's minutes."""
        return {reason: int(count) for reason, count in self._query(
            "SELECT reason, SUM(count) FROM refusal_counts WHERE minute >= ? GROUP BY reason ORDER BY reason",
            (since,))}

    def latencies(self, *, since: float, quantiles: Sequence[float]) -> Latencies:
        """The requests from `since` (by `ts`), their 5xx, and each quantile q (0 <= q < 1) of `ttft_s` (rows that have
        one) and `total_s`: of n values in order, the one at rank int(q * n) from 0, None of none. In one statement,
        ranked in SQL (ROW_NUMBER and COUNT over the window): the database sorts, only the ranks asked for come
        back. /admin/ops read every row of the window into Python and sorted them there: 200k rows, 2-4 s of the
        gateway's interpreter (GIL) a poll."""
        if any(not 0 <= q < 1 for q in quantiles):
            raise ValueError(f"quantiles are in [0, 1): {list(quantiles)}")

        def at_rank(rank: str, count: str) -> str:  # rank = int(q * count), a quantile's: q * count in [rank, rank + 1)
            return " OR ".join(f"({rank} <= ? * {count} AND ? * {count} < {rank} + 1)" for _ in quantiles)

        twice = tuple(q for q in quantiles for _ in range(2))
        sql = ("SELECT n, errors, ttft_s, ttft_rank, ttft_n, total_s, total_rank FROM ("
               "SELECT ttft_s, total_s, COUNT(*) OVER () AS n, "
               "SUM(CASE WHEN http_status >= 500 THEN 1 ELSE 0 END) OVER () AS errors, "
               "ROW_NUMBER() OVER (PARTITION BY ttft_s IS NULL ORDER BY ttft_s) - 1 AS ttft_rank, "
               "COUNT(ttft_s) OVER () AS ttft_n, ROW_NUMBER() OVER (ORDER BY total_s) - 1 AS total_rank "
               "FROM requests WHERE ts >= ?) ranked "
               f"WHERE (ttft_s IS NOT NULL AND ({at_rank('ttft_rank', 'ttft_n')})) OR {at_rank('total_rank', 'n')}")
        ttft: dict[float, float | None] = dict.fromkeys(quantiles)
        total: dict[float, float | None] = dict.fromkeys(quantiles)
        requests = errors = 0
        for n, errors_, ttft_s, ttft_rank, ttft_n, total_s, total_rank in self._query(sql, (since, *twice, *twice)):
            requests, errors = int(n), int(errors_)
            for q in quantiles:
                if ttft_s is not None and ttft_rank == int(q * ttft_n):
                    ttft[q] = ttft_s
                if total_rank == int(q * n):
                    total[q] = total_s
        return Latencies(requests, errors, ttft, total)

    def refusal_totals(self, *, tenant: str | None = None, since: float | None = None,
                       until: float | None = None) -> list[RefusalTotal]:
        """Refusal counts summed in SQL per UTC day, tenant, key and reason (the minutes `refusal_counts` would
        give), in the order each first occurred: the earliest minute, then tenant, key and reason. A tenant's are
        found by the (tenant, minute) index, not by reading every tenant's."""
        where, args = _where("minute", tenant, since, until)
        sql = (f"SELECT {self._day_start('minute')}, tenant, key_id, reason, SUM(count), MIN(minute) "
               f"FROM refusal_counts WHERE {where} GROUP BY 1, 2, 3, 4 ORDER BY 6, 2, 3, 4")
        return [RefusalTotal(int(day), tenant_, key_id, reason, int(count), int(first))
                for day, tenant_, key_id, reason, count, first in self._query(sql, args)]

    def request_totals(self, by: Sequence[str], *, tenant: str | None = None, since: float | None = None,
                       until: float | None = None) -> list[RequestTotals]:
        """The requests' sums per distinct value of the groups `by` (of REPORT_GROUPS; "day" is the UTC day of
        `ts`, given as its first second), in no particular order; `since` and `until` select by `ts`."""
        keys = [self._group_sql(g) for g in by]
        where, args = _where("ts", tenant, since, until)
        return self._sum_requests(keys, where, args)

    def marks(self, *, tenant: str | None, since: float, until: float, by_day: bool, requests: bool = True,
              refusals: bool = True) -> dict[int | None, Marks]:
        """The Marks of [since, until) per UTC day (its first second) that has any, or of all of it (key None):
        counted in SQL over the (tenant, ts) index (the requests' count reads nothing else) and (tenant, minute).
        Without `requests` (`refusals`), their fields are left 0 (0 and None): that table is not read."""
        out: dict[int | None, list[Any]] = {}
        group = " GROUP BY 1" if by_day else ""
        if requests:
            day = f"{self._day_start(self._TS_SECOND)}, " if by_day else ""
            where, args = _where("ts", tenant, since, until)
            for *key, rows in self._query(f"SELECT {day}COUNT(*) FROM requests WHERE {where}{group}", args):
                out.setdefault(key[0] if key else None, [0, 0, None])[0] = int(rows)
        if refusals:
            day = f"{self._day_start('minute')}, " if by_day else ""
            where, args = _where("minute", tenant, since, until)
            for *key, refused, first in self._query(f"SELECT {day}SUM(count), MIN(minute) FROM refusal_counts "
                                                    f"WHERE {where}{group}", args):
                out.setdefault(key[0] if key else None, [0, 0, None])[1:] = int(refused or 0), first
        return {(None if k is None else int(k)): Marks(*v) for k, v in out.items() if v != [0, 0, None]}

    def first_second(self, *, tenant: str | None) -> int | None:
        """The earliest whole second of the requests and refusal counts (`tenant`'s), None if none: MIN of an indexed
        column, one index look-up each."""
        times = []
        for table, column in (("requests", "ts"), ("refusal_counts", "minute")):
            where, args = _where(column, tenant, None, None)
            ((found,),) = self._query(f"SELECT MIN({column}) FROM {table} WHERE {where}", args)
            if found is not None:
                times.append(math.floor(found))
        return min(times) if times else None

    def _group_sql(self, group: str) -> str:
        if group == "day":
            return self._day_start(self._TS_SECOND)
        if group in REPORT_GROUPS:
            return group
        raise ValueError(f"cannot group by {group!r}; choose from {', '.join(REPORT_GROUPS)}")

    def fallback_pending(self, since: float, limit: int) -> list[tuple[str, str, Decimal, str]]:
        """(request id, tenant, price, fallback mark) of rows since `since` settled on a quota fallback whose money
        Redis' counters do not have yet (`fallback_pending` lists them), oldest first. Rows noted applied left that
        list: they cost this read nothing."""
        found = self._query("SELECT r.request_id, r.tenant, r.price_usd, r.fallback FROM fallback_pending p"
                            " JOIN requests r ON r.request_id = p.request_id WHERE p.ts >= ? ORDER BY p.ts LIMIT ?",
                            (since, limit))
        return [(rid, tenant, Decimal(str(price)), mark) for rid, tenant, price, mark in found]

    def get(self, request_id: str) -> LedgerRow | None:
        found = self._query(f"SELECT {', '.join(COLUMNS)} FROM requests WHERE request_id = ?", (request_id,))
        return from_db(found[0]) if found else None


def read_fault(exc: BaseException) -> bool:
    """Whether a read's exception is the database failing it for now, so that the same read later may work: PostgreSQL
    down or restarting, the pool's connections all taken (psycopg_pool's PoolTimeout), a statement cancelled at
    READ_TIMEOUT_S (QueryCanceled) or by an operator (psycopg's OperationalError, all of them); SQLite's file locked,
    busy, unreadable or not opened (an OperationalError whose code is not an SQL error). Not one: anything else, a
    bug (an SQL error, a value a row cannot be read as). It may have crossed a report process's pipe (pickled: its
    class, text and SQLite code are kept)."""
    if isinstance(exc, sqlite3.OperationalError):
        return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF != SQLITE_ERROR
    return isinstance(exc, psycopg.OperationalError)


def open_reader(source: ReadSource) -> Reader:
    """A read-only reader of the ledger at `source`, on a connection of its own (close it when done)."""
    if source.kind == "sqlite":
        from quotas.ledger_sqlite import SQLiteReader

        return SQLiteReader(source.target)
    if source.kind == "postgres":
        from quotas.ledger_postgres import PostgresReader

        return PostgresReader(source.target)
    raise ValueError(f"no ledger reader for {source.kind!r}")


def store_identity(source: ReadSource, reader: LedgerReads | None) -> tuple[Any, ...]:
    """What tells the database at `source` from another put at the same place later (a reset, a restore, a migration):
    the SQLite file's device and inode (of the path now: a reader kept open reads the file it opened), the PostgreSQL
    database's OID (a database dropped and made again under its name gets another)."""
    if source.kind == "sqlite":
        st = os.stat(source.target)
        return st.st_dev, st.st_ino
    if reader is None:
        raise ValueError(f"the identity of a {source.kind} ledger is read through a reader")
    ((oid,),) = reader._query("SELECT oid FROM pg_database WHERE datname = current_database()", ())
    return (int(oid),)


class Reader(LedgerReads):
    """A reader of a ledger's database on one connection: for one thread at a time."""

    @abstractmethod
    def close(self) -> None:
        """Close its connection."""


def _where(time_column: str, tenant: str | None, since: float | None,
           until: float | None) -> tuple[str, tuple[Any, ...]]:
    clauses, args = ["1=1"], []
    for clause, value in (("tenant = ?", tenant), (f"{time_column} >= ?", since), (f"{time_column} < ?", until)):
        if value is not None:
            clauses.append(clause)
            args.append(value)
    return " AND ".join(clauses), tuple(args)


def _select_sql(table: str, columns: list[str], time_column: str, tenant: str | None, since: float | None,
                until: float | None) -> tuple[str, tuple[Any, ...]]:
    where, args = _where(time_column, tenant, since, until)
    order = ", ".join(["ts", "request_id"] if table == "requests" else [time_column])
    return f"SELECT {', '.join(columns)} FROM {table} WHERE {where} ORDER BY {order}", args
