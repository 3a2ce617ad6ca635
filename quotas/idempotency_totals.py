"""Each tenant's idempotency totals in PostgreSQL (`idempotency_tenants`: live records and stored bytes), kept by
triggers in the statement that changes the records, as SQLite's triggers keep its own (quotas/idempotency.py).

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
