"""A SQLite file in the data directory that is not a database, or is locked, is one line naming the file and the
setting that chose its directory: sqlite3's own message ("file is not a database") names neither."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gateway.cli.main import cli
from gateway.tenants.store import TenantStore

STATE_READERS = [["tenants", "list"], ["keys", "list"], ["usage", "--tenant", "acme"], ["degrade", "status"],
                 ["degrade", "history"], ["rollout", "status"], ["rollout", "history"]]


def run(args: list[str], **env: str | None) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "", **env})


def error_line(r: Result) -> str:
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), f"{r.exception!r} {r.output}"
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error:"), r.output
    return last


@pytest.mark.parametrize("args", STATE_READERS, ids=[" ".join(a) for a in STATE_READERS])
def test_a_state_file_that_is_no_database_is_named_with_its_setting(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "state.db").write_bytes(os.urandom(4096))
    line = error_line(run(args, TIERGATE_DATA_DIR=str(tmp_path)))
    assert f"{tmp_path / 'state.db'}: not a SQLite database (TIERGATE_DATA_DIR={tmp_path})" in line, line


def test_a_ledger_that_is_no_database_is_named_with_the_flag_that_chose_it(tmp_path: Path) -> None:
    TenantStore(tmp_path / "state.db").close()
    (tmp_path / "ledger.db").write_bytes(os.urandom(4096))
    line = error_line(run(["usage", "--data-dir", str(tmp_path)]))
    assert f"{tmp_path / 'ledger.db'}: not a SQLite database (--data-dir {tmp_path})" in line, line


def test_the_default_data_dir_says_the_setting_is_unset(tmp_path: Path) -> None:
    state = tmp_path / ".local" / "share" / "tiergate" / "state.db"
    state.parent.mkdir(parents=True)
    state.write_bytes(os.urandom(4096))
    line = error_line(run(["tenants", "list"], HOME=str(tmp_path), TIERGATE_DATA_DIR=None))
    assert f"{state}: not a SQLite database (TIERGATE_DATA_DIR unset: the default)" in line, line


def test_a_locked_state_file_is_named(tmp_path: Path) -> None:
    TenantStore(tmp_path / "state.db").close()
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # a running gateway's long write, from outside
    try:
        line = error_line(run(["tenants", "create", "acme", "--data-dir", str(tmp_path)]))
    finally:
        holder.close()
    assert line.startswith(f"Error: {tmp_path / 'state.db'}: database is locked") and "retry" in line, line
