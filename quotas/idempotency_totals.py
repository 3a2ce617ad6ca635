"""Each tenant's idempotency totals (`idempotency_tenants`: live records and stored bytes), kept by triggers in the
statement that changes the records, in SQLite (`SQLITE_TOTALS`) and in PostgreSQL (`IDEMPOTENCY_TOTALS`); a claim of a
new key reads one row, not the tenant's records (quotas/idempotency.py).

Triggers, not the claim's SQL, keep them, so every writer keeps them exact: a claim, the answer a group commit of the
ledger stores (its size), an abandon, a prune, a takeover of an expired key, and the writes of a replica of the
release before, during a rolling upgrade. One trigger a statement (transition tables), not one a row: a prune of
thousands of records changes each tenant's row once. Each statement's changes are applied in tenant order (byte
order, "C", which is Python's order of the same strings), and a group commit runs its rows' statements in that order
(quotas/ledger_postgres.py), so transactions that change several tenants take their totals rows' locks in one order
and cannot deadlock on them.

A claim of a new key locks its tenant's row (`SELECT ... FOR UPDATE`, which reads the row's newest version) before it
checks the room and inserts, and holds it until its statement commits: claims of one tenant's new keys are
serialized, across replicas, so the bound is exact.
"""

from __future__ import annotations

import sqlite3

# SQLite's, in the transaction that changes the records (a claim, a prune, an answer committed by the ledger's writer).
# Expired records count until deleted; a tenant at its bound deletes its own (`idempotency_tenant_expires`) first.
SQLITE_TOTALS = (
    "CREATE TABLE IF NOT EXISTS idempotency_tenants (tenant TEXT PRIMARY KEY, records INTEGER NOT NULL, "
    "bytes INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS idempotency_tenant_expires ON idempotency(tenant, expires)",
    """CREATE TRIGGER IF NOT EXISTS idempotency_added AFTER INSERT ON idempotency BEGIN
        INSERT INTO idempotency_tenants VALUES (new.tenant, 1, new.size)
        ON CONFLICT (tenant) DO UPDATE SET records = records + 1, bytes = bytes + excluded.bytes;
    END""",
    """CREATE TRIGGER IF NOT EXISTS idempotency_removed AFTER DELETE ON idempotency BEGIN
        UPDATE idempotency_tenants SET records = records - 1, bytes = bytes - old.size WHERE tenant = old.tenant;
    END""",
    """CREATE TRIGGER IF NOT EXISTS idempotency_resized AFTER UPDATE OF size ON idempotency BEGIN
        UPDATE idempotency_tenants SET bytes = bytes + new.size - old.size WHERE tenant = new.tenant;
    END""",
)


def migrate_sqlite(conn: sqlite3.Connection) -> None:
    """A ledger file from before the bounds: its records get a size (0: they expire within a TTL) and the
    tenants' totals are counted once, in the transaction that creates the triggers that keep them."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "size" not in {col[1] for col in conn.execute("PRAGMA table_info(idempotency)")}:
            conn.execute("ALTER TABLE idempotency ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
        counted = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'idempotency_tenants'").fetchone()
        for statement in SQLITE_TOTALS:
            conn.execute(statement)
        if counted is None:
            conn.execute("INSERT INTO idempotency_tenants SELECT tenant, count(*), total(size) FROM idempotency "
                         "GROUP BY tenant")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# the migration's body (quotas/ledger_postgres.py, migration 5): the function and its three triggers
IDEMPOTENCY_TOTALS = """
CREATE FUNCTION tiergate_idempotency_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO idempotency_tenants AS t
        SELECT tenant, count(*), coalesce(sum(octet_length(answer)), 0) FROM new_rows GROUP BY tenant
        ORDER BY tenant COLLATE "C"
        ON CONFLICT (tenant) DO UPDATE SET records = t.records + excluded.records, bytes = t.bytes + excluded.bytes;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO idempotency_tenants AS t
        SELECT tenant, -count(*), -coalesce(sum(octet_length(answer)), 0) FROM old_rows GROUP BY tenant
        ORDER BY tenant COLLATE "C"
        ON CONFLICT (tenant) DO UPDATE SET records = t.records + excluded.records, bytes = t.bytes + excluded.bytes;
    ELSE  -- an answer stored, or an expired key taken over: the same records, other sizes
        INSERT INTO idempotency_tenants AS t
        SELECT tenant, 0, sum(size) FROM (
            SELECT tenant, coalesce(octet_length(answer), 0) AS size FROM new_rows
            UNION ALL SELECT tenant, -coalesce(octet_length(answer), 0) FROM old_rows) AS changed
        GROUP BY tenant HAVING sum(size) <> 0 ORDER BY tenant COLLATE "C"
        ON CONFLICT (tenant) DO UPDATE SET bytes = t.bytes + excluded.bytes;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER idempotency_added AFTER INSERT ON idempotency REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tiergate_idempotency_count();
CREATE TRIGGER idempotency_removed AFTER DELETE ON idempotency REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tiergate_idempotency_count();
CREATE TRIGGER idempotency_resized AFTER UPDATE ON idempotency REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tiergate_idempotency_count();
"""
