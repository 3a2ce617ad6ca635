"""The fleet database: PostgreSQL, shared by every gateway replica (`TIERGATE_DATABASE_URL=postgresql://…`).

What lives there: tenants, keys (hashes), data versions (gateway/tenants/store_postgres.py), the usage ledger,
refusal counts and idempotency records (quotas/ledger_postgres.py, quotas/idempotency.py), and the ladder's
audit (gateway/ladder/state.py). Each store owns its tables as one *component* with a numbered list of
migrations; `migrate` applies the ones a database lacks, in order, in one transaction per component, under an
advisory lock, so replicas that start together apply each migration once and a fleet's database is upgraded
in place by the first replica of a new release. Migrations only add (tables, columns with defaults, indexes,
triggers), so replicas of the previous release keep working beside it during a rolling upgrade.

The stores share this module's conventions: SQL is written once with `?` placeholders, as SQLite takes them,
and `pg` turns them into psycopg's `%s`; `is_db_fault` tells a fault of the database (retry later) from one a
row's own values caused (refuse that row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import errors as pg_errors

log = logging.getLogger("tiergate.fleet_db")

CONNECT_TIMEOUT_S = 5  # libpq's connect_timeout: whole seconds
_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS tiergate_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (component, version)
)"""
_MIGRATION_LOCK = 0x7469657267617465  # "tiergate": one advisory lock for every component's migrations


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0] in ("postgresql", "postgres")  # type: ignore[union-attr]


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection in autocommit mode (transactions are explicit), failing after CONNECT_TIMEOUT_S."""
    return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **kwargs)


@lru_cache(maxsize=256)
def pg(sql: str) -> str:
    """SQL written with SQLite's `?` placeholders, for psycopg (none of our statements has a literal `?` or %)."""
    return sql.replace("?", "%s")


def migrate(conn: psycopg.Connection[Any], component: str, migrations: Sequence[str], *,
            upto: int | None = None) -> int:
    """Apply `component`'s migrations numbered 1..`upto` (default: all) that the database lacks; returns the
    version it is at. A database already past what this code knows (a newer release) is left as it is."""
    target = len(migrations) if upto is None else upto
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(_MIGRATIONS_TABLE)
        done = {v for (v,) in conn.execute("SELECT version FROM tiergate_migrations WHERE component = %s",
                                           (component,))}
        for version, sql in enumerate(migrations[:target], start=1):
            if version in done:
                continue
            conn.execute(sql)  # several statements, no parameters
            conn.execute("INSERT INTO tiergate_migrations VALUES (%s, %s, %s)", (component, version, time.time()))
            log.warning("fleet database: %s migrated to version %d", component, version)
            done.add(version)
    newest = max(done, default=0)
    if newest > len(migrations):
        log.warning("fleet database: %s is at version %d, newer than this release knows (%d); its additions are "
                    "ignored", component, newest, len(migrations))
    return newest


def version_of(conn: psycopg.Connection[Any], component: str) -> int:
    """The newest migration applied for `component` (0: none, or no migrations table yet)."""
    if conn.execute("SELECT to_regclass('tiergate_migrations')").fetchone()[0] is None:  # type: ignore[index]
        return 0
    row = conn.execute("SELECT max(version) FROM tiergate_migrations WHERE component = %s", (component,)).fetchone()
    return int(row[0] or 0) if row else 0


def is_db_fault(exc: BaseException) -> bool:
    """A fault of the database or the way to it (connection lost, disk full, shutting down, a deadlock): retry
    later. Not one: a constraint or a value the row brought (a duplicate id, a number out of range), or a
    Python value psycopg cannot send at all."""
    if isinstance(exc, pg_errors.IntegrityError | pg_errors.DataError):
        return False
    if isinstance(exc, psycopg.ProgrammingError) and exc.sqlstate is None:  # refused before it was sent
        return False
    return isinstance(exc, psycopg.Error)


def fault_name(exc: BaseException) -> str:
    """What to call a fault in a log line or a not-ready reason: its SQLSTATE's name, else its class."""
    diag = getattr(exc, "sqlstate", None)
    return f"{type(exc).__name__} {diag}" if diag else type(exc).__name__
