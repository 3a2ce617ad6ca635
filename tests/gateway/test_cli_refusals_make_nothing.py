"""A command that changes state, refused on a data directory with none, refuses before it opens a store: one line,
a non-zero exit, and no file made. Each made state.db first (opening a store makes it), then refused: a LEVEL not in
the ladder, a rollout's unknown tier or bad guard, a key or tenant that cannot be there. Changing a tenant, a key or a
rollout needs the state they are in (as reading one does, tests/gateway/test_cli_read_only.py); what makes state from
nothing (tenants create, keys issue --admin, degrade set and auto, rollout start) still does, once its input passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gateway.cli.main import cli
from tests.gateway.test_rollout import tiers_yaml

NO_STATE = "no state at {dir}/state.db: no gateway has run on this data directory and nothing was set up in it"
REFUSED = [
    (["tenants", "set-plan", "acme", "free"], NO_STATE),
    (["tenants", "bump-data-version", "acme"], NO_STATE),
    (["keys", "issue", "--tenant", "acme"], NO_STATE),
    (["keys", "revoke", "0123456789ab"], NO_STATE),
    (["keys", "rotate", "0123456789ab"], NO_STATE),
    (["degrade", "set", "panic", "--reason", "drill"], "Invalid value for 'LEVEL': no level 'panic' in the ladder"),
    (["degrade", "set", "99", "--reason", "drill"], "Invalid value for 'LEVEL': no level '99' in the ladder"),
    (["degrade", "set", "protect", "--reason", " "], "Invalid value for '--reason': a reason is required"),
    (["rollout", "start", "mdi", "v2", "--reason", "x"], "no tier 'mdi'; tiers: small, mid, full"),
    (["rollout", "start", "mid", "v3", "--reason", "x"], "tier 'mid' has no version 'v3'; it has v1, v2"),
    (["rollout", "start", "mid", "v2", "--reason", " "], "a reason is required (it is kept in the audit trail)"),
    (["rollout", "start", "mid", "v2", "--reason", "x", "--shadow", "0.1", "--share", "0.5"],
     "a shadow answers no one from the candidate"),
    (["rollout", "start", "mid", "v2", "--reason", "x", "--max-error-rate", "-1"], "guards.max_error_rate: "),
    (["rollout", "start", "mid", "v2", "--reason", "x", "--window", "nan"], "guards.window_s: "),
    (["rollout", "start", "mid", "v2", "--reason", "x", "--tenant", "acme"], NO_STATE),
    (["rollout", "promote", "mid", "--reason", "x"], NO_STATE),
    (["rollout", "pause", "mid", "--reason", "x"], NO_STATE),
    (["rollout", "rollback", "mid", "--reason", "x"], NO_STATE),
]


def run(args: list[str], data_dir: Path, tiers: Path) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "",
                                              "TIERGATE_DATA_DIR": str(data_dir), "TIERGATE_TIERS_FILE": str(tiers)})


@pytest.fixture
def tiers(tmp_path: Path) -> Path:
    """A tiers file whose `mid` has versions v1 (serving) and v2, outside the data directory."""
    path = tmp_path / "tiers.yaml"
    path.write_text(tiers_yaml("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1"))
    return path


@pytest.mark.parametrize(("args", "said"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_refused_change_makes_no_state(tmp_path: Path, tiers: Path, args: list[str], said: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    r = run(args, data, tiers)
    assert r.exit_code in (1, 2) and isinstance(r.exception, SystemExit), f"{r.exception!r} {r.output}"
    (line,) = [line for line in r.output.splitlines() if line.startswith("Error: ")]
    assert said.format(dir=data) in line, r.output
    assert list(data.iterdir()) == []


@pytest.mark.parametrize("args", [["rollout", "start", "mid", "v2", "--share", "0.1", "--reason", "before the fleet"],
                                  ["degrade", "set", "protect", "--reason", "drill"]])
def test_what_passes_its_checks_still_makes_state_from_nothing(tmp_path: Path, tiers: Path, args: list[str]) -> None:
    r = run(args, tmp_path, tiers)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "state.db").exists()
    status = run([args[0], "status"], tmp_path, tiers)
    assert status.exit_code == 0, status.output
    assert ("mid: v2 over v1, canary 10.00%" if args[0] == "rollout" else "level 2 (protect), set by") in status.output
