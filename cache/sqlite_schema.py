"""The tables of `SQLiteStore` (cache/sqlite_store.py), the triggers that keep each tenant's count and bytes (the
per-tenant byte budget's), the entry count and the change log, and the measuring of a file written before the byte
budget (`add_sizes`); and an entry as a row of `entries` (`entry_row`) and back (`entry_of`). Triggers, not the
store's SQL, keep the counts, so every process that writes the file keeps them.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import numpy as np

from cache.store import Entry

SCHEMA = """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS entries (
    entry_id TEXT PRIMARY KEY,
    scope_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    data_version TEXT NOT NULL,
    model_version TEXT NOT NULL,
    exact_key TEXT NOT NULL,
    partition TEXT NOT NULL,
    semantic_text TEXT NOT NULL,
    response TEXT NOT NULL,
    usage TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    last_used REAL NOT NULL,
    embedding BLOB,
    size INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS entries_exact ON entries (scope_id, exact_key);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries (tenant, data_version);
CREATE INDEX IF NOT EXISTS entries_tenant_lru ON entries (tenant, last_used);
CREATE INDEX IF NOT EXISTS entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op TEXT NOT NULL,
    entry_id TEXT NOT NULL,
    partition TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenant_sizes (tenant TEXT PRIMARY KEY, n INTEGER NOT NULL, bytes INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS data_bumps (tenant TEXT PRIMARY KEY, version TEXT NOT NULL, bumped_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS entry_count (id INTEGER PRIMARY KEY CHECK (id = 0), n INTEGER NOT NULL);
INSERT INTO tenant_sizes (tenant, n, bytes) SELECT tenant, COUNT(*), SUM(size) FROM entries
    WHERE NOT EXISTS (SELECT 1 FROM entry_count) GROUP BY tenant;
INSERT OR IGNORE INTO entry_count (id, n) SELECT 0, COUNT(*) FROM entries;
"""
# What keeps each tenant's size and the change log: one statement each (`add_sizes` runs them one by one too)
TRIGGERS = ("""CREATE TRIGGER IF NOT EXISTS entries_put AFTER INSERT ON entries BEGIN
    INSERT INTO tenant_sizes (tenant, n, bytes) VALUES (NEW.tenant, 1, NEW.size)
        ON CONFLICT (tenant) DO UPDATE SET n = n + 1, bytes = bytes + NEW.size;
    UPDATE entry_count SET n = n + 1;
    INSERT INTO changes (op, entry_id, partition) SELECT 'put', NEW.entry_id, NEW.partition
        WHERE NEW.embedding IS NOT NULL;
END""", """CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE tenant_sizes SET n = n - 1, bytes = bytes - OLD.size WHERE tenant = OLD.tenant;
    UPDATE entry_count SET n = n - 1;
    INSERT INTO changes (op, entry_id, partition) VALUES ('del', OLD.entry_id, OLD.partition);
END""")
SCHEMA += "".join(f"{trigger};\n" for trigger in TRIGGERS) + "COMMIT;\n"

# Files written before the byte budget: each row's size (`stored_bytes`, counted in SQL) and each tenant's total, once;
# their triggers are replaced by the schema's, which count sizes too, in the same transaction (dropped alone, until
# `SCHEMA` made them again, a write by another process, a gateway of before still running, counted nothing).
_TEXT_COLUMNS = ("entry_id", "scope_id", "tenant", "data_version", "model_version", "exact_key", "partition",
                 "semantic_text", "response", "usage", "metadata")
_SIZE_SQL = " + ".join([f"length(CAST({c} AS BLOB))" for c in _TEXT_COLUMNS] + ["COALESCE(length(embedding), 0)"])
_ADD_SIZES = f"""
ALTER TABLE entries ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
UPDATE entries SET size = {_SIZE_SQL};
DROP TRIGGER IF EXISTS entries_put;
DROP TRIGGER IF EXISTS entries_del;
"""
_ADD_TENANT_BYTES = """
ALTER TABLE tenant_sizes ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
UPDATE tenant_sizes SET bytes = (SELECT COALESCE(SUM(size), 0) FROM entries WHERE entries.tenant = tenant_sizes.tenant);
"""


def add_sizes(db: sqlite3.Connection) -> None:
    """Count sizes in a file written before the byte budget (`_ADD_SIZES`), in one transaction."""
    def columns(table: str) -> set[str]:
        return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}

    if "size" in columns("entries") or not columns("entries"):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        if "size" not in columns("entries"):  # not added meanwhile by another process
            for statement in filter(str.strip, _ADD_SIZES.split(";")):
                db.execute(statement)
            if columns("tenant_sizes") and "bytes" not in columns("tenant_sizes"):
                for statement in filter(str.strip, _ADD_TENANT_BYTES.split(";")):
                    db.execute(statement)
            if all(columns(table) for table in ("tenant_sizes", "entry_count", "changes")):
                for trigger in TRIGGERS:  # what they count exists: counted from this commit on
                    db.execute(trigger)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


# -- an entry as a row of `entries`, and back ---------------------------------------------------------------------

COLUMNS = ("entry_id, scope_id, tenant, data_version, model_version, exact_key, partition, semantic_text, "
           "response, usage, metadata, created_at, expires_at, last_used, embedding")


def entry_row(entry: Entry, size: int) -> tuple[Any, ...]:
    """`entry`'s values in the order of COLUMNS, then its `size`."""
    blob = None if entry.embedding is None else np.asarray(entry.embedding, dtype=np.float32).tobytes()
    return (entry.entry_id, entry.scope_id, entry.tenant, entry.data_version, entry.model_version, entry.exact_key,
            entry.partition, entry.semantic_text, entry.response, json.dumps(entry.usage),
            json.dumps(entry.metadata), entry.created_at, entry.expires_at, entry.last_used, blob, size)


def entry_of(row: tuple[Any, ...]) -> Entry:
    """The entry of a row read as COLUMNS."""
    blob = row[14]
    return Entry(entry_id=row[0], scope_id=row[1], tenant=row[2], data_version=row[3], model_version=row[4],
                 exact_key=row[5], partition=row[6], semantic_text=row[7], response=row[8], usage=json.loads(row[9]),
                 metadata=json.loads(row[10]), created_at=row[11], expires_at=row[12], last_used=row[13],
                 embedding=None if blob is None else np.frombuffer(blob, dtype=np.float32))
