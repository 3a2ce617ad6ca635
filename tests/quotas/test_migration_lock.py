"""The wait for the fleet database's migration lock (quotas/fleet_db.py) is bounded: a session that holds it and never
lets go (a replica hung mid-migration, an operator's psql left open) stops a starting replica with an error that
names that session, where the replica waited without end and logged nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

from gateway.cli.errors import describe
from quotas import fleet_db
from quotas.fleet_db import _MIGRATION_LOCK, MigrationLockTimeout
from quotas.ledger_postgres import MIGRATIONS, open_schema


def _start_while_held(database_url: str, let_go: Callable[[], object]) -> tuple[list[BaseException | int], bool]:
    """A replica's start-up (`open_schema`) in a thread, given 10 s; then `let_go` (what it waited on) and 10 s more
    for a hung one to finish. What start-up ended with (its migrations' count or its error), and whether it hung."""
    ended: list[BaseException | int] = []

    def start() -> None:
        try:
            ended.append(open_schema(database_url))
        except BaseException as exc:  # what start-up ended with is the test's
            ended.append(exc)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(10)
    hung = starting.is_alive()
    let_go()
    starting.join(10)
    return ended, hung


def test_a_migration_lock_held_without_end_stops_start_up_naming_its_holder(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_db, "LOCK_WAIT_S", 0.5, raising=False)
    holder = psycopg.connect(database_url, autocommit=True, application_name="stuck-migration")
    try:
        pid = holder.info.backend_pid
        holder.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        ended, hung = _start_while_held(database_url, lambda: holder.execute(
            "SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,)))  # lets a hung one finish
        assert not hung and len(ended) == 1 and isinstance(ended[0], MigrationLockTimeout)
        text = str(ended[0])
        assert f"pid {pid}" in text and "'stuck-migration'" in text and "pg_advisory_lock" in text
        line = describe(ended[0])  # the CLI's one line, no traceback
        assert line is not None and line.startswith("PostgreSQL (TIERGATE_DATABASE_URL): ledger's migrations waited")
        assert open_schema(database_url) == len(MIGRATIONS)  # the lock let go: the next start migrates
    finally:
        holder.close()


def test_a_migration_waiting_on_a_table_another_transaction_holds_gives_up_and_names_it(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction left open on the ledger's table (a psql session, a stuck report) during an upgrade: the ALTER
    TABLE of migration 3 waited for it without end, and every statement on the table queued behind it (the gateway's
    writes too). Its wait is bounded, tried again, then start-up stops naming the open transaction; nothing of that
    migration is applied, and the next start, the table free, applies it."""
    monkeypatch.setattr(fleet_db, "TABLE_LOCK_WAIT_S", 0.2, raising=False)
    monkeypatch.setattr(fleet_db, "TABLE_LOCK_TRIES", 2, raising=False)
    assert open_schema(database_url, upto=2) == 2
    holder = psycopg.connect(database_url, application_name="open-psql")  # not autocommit: its transaction stays
    try:
        pid = holder.info.backend_pid
        holder.execute("SELECT count(*) FROM requests")
        ended, hung = _start_while_held(database_url, holder.rollback)  # the rollback lets a hung one finish
        assert not hung and len(ended) == 1 and isinstance(ended[0], MigrationLockTimeout)
        assert "ledger's migration 3 could not lock its tables" in str(ended[0])
        assert f"pid {pid}" in str(ended[0]) and "'open-psql'" in str(ended[0])
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT max(version) FROM tiergate_migrations").fetchone() == (2,)
        assert open_schema(database_url) == len(MIGRATIONS)
    finally:
        holder.close()
