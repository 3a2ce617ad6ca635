"""`tiergate degrade` as on-call uses it at 3 a.m.: `status` lists the ladder's levels, `set` takes a level by number
or by name, and a bad LEVEL or --ttl is one line naming the argument, before anything changes."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from gateway.cli.main import cli
from gateway.tenants.store import TenantStore

LADDER = Path(__file__).resolve().parents[2] / "degrade_ladder.yaml"


def run(tmp_path: Path, *args: str) -> Result:
    if not (tmp_path / "state.db").exists():
        TenantStore(tmp_path / "state.db").close()  # a gateway's data directory: one started there
    env = {"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "", "TIERGATE_DATA_DIR": str(tmp_path),
           "TIERGATE_LADDER_FILE": str(LADDER)}
    return CliRunner().invoke(cli, ["degrade", *args], env=env)


def last_line(r: Result) -> str:
    assert isinstance(r.exception, SystemExit), f"{r.exception!r}"  # no traceback
    return r.output.strip().splitlines()[-1]


def test_status_lists_the_levels_and_marks_the_one_in_force(tmp_path: Path) -> None:
    out = run(tmp_path, "status").output
    assert " * 0 normal" in out
    assert "   3 survive: shed batch and standard traffic" in out


def test_set_takes_a_level_by_name_and_says_until_when(tmp_path: Path) -> None:
    r = run(tmp_path, "set", "protect", "--reason", "drill", "--ttl", "1d")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("level 2 (protect) held until ")
    status = run(tmp_path, "status").output
    assert status.startswith("level 2 (protect), set by manual") and " * 2 protect" in status
    assert "manual for 86400s: drill" in run(tmp_path, "history").output


def test_an_unknown_level_lists_the_levels(tmp_path: Path) -> None:
    for level in ("9", "shed_free"):
        r = run(tmp_path, "set", level, "--reason", "x")
        assert r.exit_code == 2
        assert "LEVEL" in last_line(r) and "levels: 0 normal, 1 conserve, 2 protect, 3 survive" in last_line(r)
    assert run(tmp_path, "status").output.startswith("level 0 (normal), set by auto")


def test_a_bad_ttl_names_the_option_and_sets_nothing(tmp_path: Path) -> None:
    for ttl in ("0", "0s", "soon", "3651d"):
        r = run(tmp_path, "set", "1", "--reason", "x", "--ttl", ttl)
        assert r.exit_code == 2 and "'--ttl'" in last_line(r), r.output
        assert "ttl_s" not in r.output
    assert run(tmp_path, "status").output.startswith("level 0 (normal), set by auto")


def test_an_empty_history_says_so(tmp_path: Path) -> None:
    r = run(tmp_path, "history")
    assert r.exit_code == 0 and r.output.strip() == "no level changes recorded", r.output
