"""A SQLite ledger's id (quotas/ledger_identity.py) is made when the ledger opens, beside its schema, so that
`ledger_id` on the request path (RedisIdempotency's first claim) only reads it. Made there, it took the database's
write lock outside the ledger's write turns, and behind a long write that request waited out the busy timeout: a 503.
A file that only an earlier release's processes opened lacks it; `ledger_id` still makes it."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quotas.ledger import Ledger
from quotas.ledger_identity import TABLE, ledger_id


def _stored(path: Path) -> list[tuple[str]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT id FROM {TABLE}").fetchall()
    finally:
        conn.close()


def _forget_id(path: Path) -> None:
    """What a file looks like to a release from before ledger ids."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    finally:
        conn.close()


@contextmanager
def _write_locked(path: Path) -> Iterator[None]:
    """Another connection holding the database's write lock (a long write, another process's commit)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_opening_a_sqlite_ledger_makes_its_id(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    try:
        stored = _stored(path)
        assert len(stored) == 1 and stored[0][0]
        assert ledger_id(ledger.read_source()) == "sqlite:" + stored[0][0]
    finally:
        ledger.close()
    reopened = Ledger(path)  # kept, not made again
    reopened.close()
    assert _stored(path) == stored


def test_a_file_of_an_earlier_release_gains_its_id_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    Ledger(path).close()
    _forget_id(path)
    Ledger(path).close()
    assert len(_stored(path)) == 1


def test_ledger_id_takes_no_write_lock_while_another_writes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    try:
        with _write_locked(path):
            got = ledger_id(ledger.read_source())
        assert got == "sqlite:" + _stored(path)[0][0]
    finally:
        ledger.close()


def test_a_file_that_only_an_older_process_opened_gets_its_id_from_ledger_id(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    try:
        _forget_id(path)  # opened since by an earlier release's process, which made none
        got = ledger_id(ledger.read_source())
        assert got == "sqlite:" + _stored(path)[0][0]
        assert ledger_id(ledger.read_source()) == got
    finally:
        ledger.close()
