"""Which ledger a gateway writes (`ledger_id`): a random id kept in the ledger's own database, made by the first
process that asks and read by every later one, so that two gateways agree they write the same ledger exactly when they
do: the workers of one host in one data directory (one SQLite file), the replicas of a fleet (one PostgreSQL
database); replicas with a SQLite file each, on hosts of their own, have ids of their own, even where their files
have the same path.

A SQLite ledger makes its row when it opens (`make_sqlite`, from quotas/ledger_sqlite.py, beside its schema), so the
request path only reads it: made there, on the first claim, it took the database's write lock (BEGIN IMMEDIATE) outside
the ledger's write turns and, behind a long write, answered that request 503. A file that a process of an earlier
release opened, and no process of this one since, lacks it: `ledger_id` makes it then, as before. PostgreSQL's is
made by `ledger_id` (a migration): the gateway claims in Redis only without a fleet database (gateway/stores.py).

RedisIdempotency (quotas/idempotency_redis.py) writes it into each claim, so that a retry that finds the claim of a
gateway that died knows whether that gateway's ledger row, if any, is one it can read. A ledger file copied to
another host (restored from a backup) keeps its id: the two are then taken for one.
"""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path

from quotas.fleet_db import connect, migrate
from quotas.ledger_reads import ReadSource

TABLE = "ledger_identity"
_CREATE = f"CREATE TABLE IF NOT EXISTS {TABLE} (one INTEGER PRIMARY KEY CHECK (one = 1), id TEXT NOT NULL)"
# PostgreSQL: one migration of a component of its own (quotas/fleet_db.py), applied once by the first process
_MIGRATIONS = (f"CREATE TABLE {TABLE} (one INTEGER PRIMARY KEY CHECK (one = 1), id TEXT NOT NULL);"
               f" INSERT INTO {TABLE} VALUES (1, md5(random()::text || clock_timestamp()::text))",)


def ledger_id(source: ReadSource) -> str:
    """The id of the ledger at `source` (`Ledger.read_source()`), made on the first call. Blocking: off the event
    loop. Raises what the database raises (unreachable, locked past its busy timeout)."""
    if source.kind == "sqlite":
        return "sqlite:" + _sqlite_id(Path(source.target))
    if source.kind == "postgres":
        return "postgres:" + _postgres_id(source.target)
    raise ValueError(f"no ledger id for a ledger of kind {source.kind!r}")


def _sqlite_id(path: Path) -> str:
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    try:
        return make_sqlite(conn)
    finally:
        conn.close()


def make_sqlite(conn: sqlite3.Connection) -> str:
    """The id in the SQLite database of `conn` (autocommit), made if it has none: a read first, so the usual case
    takes no write lock; two processes making it at once, the first one's stands."""
    if (found := _read(conn)) is not None:
        return found
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(_CREATE)
        conn.execute(f"INSERT OR IGNORE INTO {TABLE} VALUES (1, ?)", (secrets.token_hex(16),))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    found = _read(conn)
    assert found is not None
    return found


def _read(conn: sqlite3.Connection) -> str | None:
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone() is None:
        return None
    found = conn.execute(f"SELECT id FROM {TABLE}").fetchone()
    return None if found is None else str(found[0])


def _postgres_id(url: str) -> str:
    with connect(url) as conn:
        migrate(conn, TABLE, _MIGRATIONS)
        found = conn.execute(f"SELECT id FROM {TABLE}").fetchone()
    assert found is not None
    return str(found[0])
