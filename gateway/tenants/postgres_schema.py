"""The tenant store's tables in the fleet's PostgreSQL, and how a replica hears that another committed.

Three tables (tenants, api_keys, tenant_data_versions; as in SQLite) and a change counter: every write to the three
bumps `fleet_changes.version` and sends a NOTIFY on CHANNEL in the same transaction (statement triggers, so a change
made with psql is heard too). The store's listener (gateway/tenants/store_postgres.py) waits on LISTEN and reads the
counter. The migrations are quotas/fleet_db.py's, applied under its advisory lock as each replica opens the store.
"""

from __future__ import annotations

from quotas.fleet_db import connect, migrate

COMPONENT = "tenants"
CHANNEL = "tiergate_fleet"
# 1: the tables of the release before the fleet store (as in SQLite); 2: the change counter and its triggers
MIGRATIONS = [
    """
    CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        plan TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY,
        tenant TEXT REFERENCES tenants(name),
        name TEXT NOT NULL DEFAULT '',
        key_sha256 TEXT NOT NULL,
        roles TEXT NOT NULL DEFAULT '[]',
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION,
        revoked_at DOUBLE PRECISION,
        replaced_by TEXT,
        limits TEXT
    );
    CREATE INDEX api_keys_tenant ON api_keys(tenant);
    CREATE TABLE tenant_data_versions (
        tenant TEXT PRIMARY KEY REFERENCES tenants(name),
        version BIGINT NOT NULL
    );
    """,
    f"""
    CREATE TABLE fleet_changes (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        version BIGINT NOT NULL
    );
    INSERT INTO fleet_changes VALUES (1, 0);
    CREATE FUNCTION tiergate_fleet_changed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE fleet_changes SET version = version + 1 WHERE id = 1;
        PERFORM pg_notify('{CHANNEL}', '');
        RETURN NULL;
    END $$;
    CREATE TRIGGER tenants_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON tenants
        FOR EACH STATEMENT EXECUTE FUNCTION tiergate_fleet_changed();
    CREATE TRIGGER api_keys_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON api_keys
        FOR EACH STATEMENT EXECUTE FUNCTION tiergate_fleet_changed();
    CREATE TRIGGER tenant_data_versions_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON tenant_data_versions
        FOR EACH STATEMENT EXECUTE FUNCTION tiergate_fleet_changed();
    """,
]
CHANGE_COUNTER_SQL = "SELECT version FROM fleet_changes WHERE id = 1"  # what the listener reads after each NOTIFY


def open_schema(url: str, *, upto: int | None = None) -> int:
    """Bring the tenant tables to this release's version (or to `upto`); returns the version."""
    with connect(url) as conn:
        return migrate(conn, COMPONENT, MIGRATIONS, upto=upto)
