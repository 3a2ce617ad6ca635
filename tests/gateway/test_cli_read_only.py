"""A command that reads state (lists, status, reports, history) on a data directory with none says so in one line,
exit status 1, and makes nothing: `usage` answered "(no usage in this period)" and made ledger.db, `degrade status`
answered "level 0" and made state.db, of a directory no gateway uses. What makes state from nothing still may."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gateway.cli.main import cli
from gateway.tenants.store import TenantStore

READERS = [["tenants", "list"], ["keys", "list"], ["keys", "list", "--tenant", "acme"], ["usage", "--tenant", "acme"],
           ["usage", "report", "--tenant", "acme"], ["degrade", "status"], ["degrade", "history"],
           ["rollout", "status"], ["rollout", "history"]]


def run(args: list[str], data_dir: Path) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "",
                                              "TIERGATE_DATA_DIR": str(data_dir)})


def error_line(r: Result) -> str:
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), f"{r.exception!r} {r.output}"
    return r.output.strip().splitlines()[-1]


@pytest.mark.parametrize("args", READERS, ids=[" ".join(a) for a in READERS])
def test_no_state_is_said_and_nothing_is_made(tmp_path: Path, args: list[str]) -> None:
    line = error_line(run(args, tmp_path))
    assert line == (f"Error: no state at {tmp_path / 'state.db'}: no gateway has run on this data directory and "
                    f"nothing was set up in it (TIERGATE_DATA_DIR={tmp_path}); nothing was made"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["usage"], ["usage", "report"], ["usage", "report", "--format", "csv"]])
def test_no_ledger_is_said_and_none_is_made(tmp_path: Path, args: list[str]) -> None:
    TenantStore(tmp_path / "state.db").close()  # tenants made, nothing served yet
    line = error_line(run(args, tmp_path))
    assert line == (f"Error: no ledger at {tmp_path / 'ledger.db'}: nothing has been served from this data directory "
                    f"(TIERGATE_DATA_DIR={tmp_path}); nothing was made"), line
    assert not (tmp_path / "ledger.db").exists()


@pytest.mark.parametrize("args", [["degrade", "auto"], ["degrade", "set", "protect", "--reason", "drill"]])
def test_a_level_may_still_be_held_before_a_gateway_starts(tmp_path: Path, args: list[str]) -> None:
    assert run(args, tmp_path).exit_code == 0
    assert (tmp_path / "state.db").exists()
    assert run(["degrade", "status"], tmp_path).exit_code == 0
