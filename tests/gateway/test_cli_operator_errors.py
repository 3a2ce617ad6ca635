"""The CLI as on-call uses it: every failure is one line and a non-zero exit, never a traceback, a secret or a
new empty data directory; every option says what it is; bad numbers are refused before any work starts."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from gateway.cli.main import cli
from gateway.tenants.store import TenantStore
from quotas.ledger import Ledger
from tests.stubs import free_port


def run(args: list[str], **env: str) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "", **env})


def refused(r: Result, *words: str) -> str:
    """The command failed with a one-line error naming `words` (CliRunner keeps a traceback as `exception`)."""
    assert r.exit_code != 0, r.output
    assert isinstance(r.exception, SystemExit), f"{r.exception!r}"  # not an uncaught error
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error:") and all(w in last for w in words), r.output
    return r.output


def test_a_database_locked_by_a_running_gateway_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    TenantStore(tmp_path / "state.db").close()
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # what a gateway's long write looks like from outside
    try:
        refused(run(["tenants", "create", "acme", "--data-dir", str(tmp_path)]), "locked", "retry")
    finally:
        holder.close()
    assert TenantStore(tmp_path / "state.db").list_tenants() == []


def test_an_unreachable_postgresql_is_one_line_without_its_password(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """At once: TIERGATE_DATABASE_START_WAIT_S is start-up's wait (gateway/stores.py), never an on-call command's,
    which would sit a minute before saying the database is down."""
    def waited(_s: float) -> None:
        raise AssertionError("the CLI command waited for the database")

    monkeypatch.setattr("gateway.stores.time.sleep", waited)
    url = f"postgresql://ops:hunter2secret@127.0.0.1:{free_port()}/tiergate"  # a closed port
    out = refused(run(["keys", "list", "--data-dir", str(tmp_path)], TIERGATE_DATABASE_URL=url,
                      TIERGATE_DATABASE_START_WAIT_S="600"), "PostgreSQL")
    assert "hunter2secret" not in out


@pytest.mark.parametrize(("name", "url", "words"), [
    ("TIERGATE_DATABASE_URL", "mysql://ops:hunter2secret@db/tiergate", ("TIERGATE_DATABASE_URL", "postgresql://")),
    ("TIERGATE_REDIS_URL", "http://:hunter2secret@cache:6379/0", ("TIERGATE_REDIS_URL", "redis://")),
])
def test_a_bad_url_setting_is_one_line_without_its_password(tmp_path: Path, name: str, url: str,
                                                            words: tuple[str, ...]) -> None:
    out = refused(run(["degrade", "status", "--data-dir", str(tmp_path)], **{name: url}), *words)
    assert "hunter2secret" not in out


@pytest.mark.parametrize("args", [["tenants", "list"], ["keys", "list"], ["keys", "revoke", "0123456789ab"],
                                  ["keys", "issue", "--tenant", "acme"], ["usage"], ["degrade", "status"],
                                  ["degrade", "auto"], ["rollout", "history"]])
def test_a_mistyped_data_dir_is_refused_and_never_made(tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "tiergte"
    refused(run([*args, "--data-dir", str(missing)]), str(missing), "does not exist")
    assert not missing.exists()
    (tmp_path / "a-file").write_text("")
    refused(run([*args, "--data-dir", str(tmp_path / "a-file")]), "not a directory")


def test_a_new_data_dir_is_still_made_by_what_creates_from_nothing(tmp_path: Path) -> None:
    assert run(["tenants", "create", "acme", "--data-dir", str(tmp_path / "a")]).exit_code == 0
    assert run(["keys", "issue", "--admin", "--data-dir", str(tmp_path / "b")]).exit_code == 0


@pytest.mark.parametrize("args", [["keys", "list", "--tenant", "acmee"], ["usage", "--tenant", "acmee"],
                                  ["usage", "report", "--tenant", "acmee"]])
def test_a_misspelt_tenant_is_no_tenant_not_one_without_keys_or_use(tmp_path: Path, args: list[str]) -> None:
    assert run(["tenants", "create", "acme", "--data-dir", str(tmp_path)]).exit_code == 0
    refused(run([*args, "--data-dir", str(tmp_path)]), "acmee")


def test_a_report_from_after_to_is_refused_not_empty(tmp_path: Path) -> None:
    assert run(["tenants", "create", "acme", "--data-dir", str(tmp_path)]).exit_code == 0
    Ledger(tmp_path / "ledger.db").close()  # a gateway started here (it makes its ledger)
    r = run(["usage", "report", "--from", "2026-12-07", "--to", "2026-12-06", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "after --to" in r.output, r.output
    assert run(["usage", "report", "--from", "2026-12-06", "--to", "2026-12-06",
                "--data-dir", str(tmp_path)]).exit_code == 0  # one day


@pytest.mark.parametrize("command", ["revoke", "rotate"])
def test_a_whole_key_given_for_its_id_is_never_echoed(tmp_path: Path, command: str) -> None:
    run(["tenants", "create", "acme", "--data-dir", str(tmp_path)])
    issued = run(["keys", "issue", "--tenant", "acme", "--data-dir", str(tmp_path)]).output
    key = next(line.split()[-1] for line in issued.splitlines() if line.startswith("key    :"))
    other = key[:3] + "ffffffffffff" + key[15:]  # the same secret under an id that does not exist
    out = refused(run(["keys", command, other, "--data-dir", str(tmp_path)]), "ffffffffffff", "not the key itself")
    assert key[16:] not in out


@pytest.mark.parametrize("group", ["degrade", "rollout"])
@pytest.mark.parametrize("limit", ["-1", "0", "99999999999999999999"])
def test_history_limits_are_bounded(tmp_path: Path, group: str, limit: str) -> None:
    r = run([group, "history", "--limit", limit, "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--limit" in r.output, r.output


@pytest.mark.parametrize("args", [
    # a teacher that is no tier nor directory: without the check, that is the error (or the download) first
    ["models", "distill", "--teacher", "/nonexistent", "--lr", "nan"],
    ["models", "distill", "--teacher", "/nonexistent", "--lr", "-1"],
    ["models", "distill", "--teacher", "/nonexistent", "--temperature", "inf"],
    ["models", "distill", "--teacher", "/nonexistent", "--greedy-weight", "nan"],
    ["models", "distill", "--teacher", "/nonexistent", "--batch-size", "0"],
    ["models", "distill", "--teacher", "/nonexistent", "--layers", "-2"],
    ["models", "distill", "--teacher", "/nonexistent", "--threads", "0"],
    ["models", "distill", "--teacher", "/nonexistent", "--budget", "nanm"],
    ["models", "distill", "--teacher", "/nonexistent", "--budget", "1e999h"],
    ["engine", "serve", "--model", "/nonexistent", "--threads", "-3"],
    ["engine", "serve", "--model", "/nonexistent", "--port", "99999"],
    ["engine", "serve", "--model", "/nonexistent", "--kv-cache-bytes", "-1"],
    ["engine", "serve", "--model", "/nonexistent", "--max-num-batched-tokens", "0"],
    ["router", "train", "--tiers", "nope", "--threads", "0"],
])
def test_bad_numbers_are_refused_before_any_work(tmp_path: Path, args: list[str]) -> None:
    r = run([*args, "--data-dir", str(tmp_path)])
    option = next(a for a in args[2:] if a.startswith("--") and a not in ("--teacher", "--model", "--tiers"))
    assert r.exit_code == 2 and f"'{option}'" in r.output, r.output


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_serve_refuses_a_port_that_cannot_be_before_preparing_anything(tmp_path: Path, port: str) -> None:
    """Named as the operator gave it: the flag (it blamed TIERGATE_PORT), or the variable."""
    (tmp_path / "broken.yaml").write_text("tiers: [\n")  # without the check, the run ends here instead
    r = run(["serve", "--port", port, "--tiers", str(tmp_path / "broken.yaml"), "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "'--port'" in r.output and "65535" in r.output and "TIERGATE_PORT" not in r.output, \
        r.output
    refused(run(["serve", "--tiers", str(tmp_path / "broken.yaml"), "--data-dir", str(tmp_path)], TIERGATE_PORT=port),
            "TIERGATE_PORT")


def test_serve_refuses_a_port_in_use_before_preparing_anything(tmp_path: Path) -> None:
    """A second `serve` on a gateway's port started engines, loaded the embedder and began first-use builds before
    uvicorn's bind failed, in a log line among theirs."""
    (tmp_path / "broken.yaml").write_text("tiers: [\n")  # without the check, the run ends here instead
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--tiers", str(tmp_path / "broken.yaml")]
        out = refused(run([*args, "--data-dir", str(tmp_path)]), f"127.0.0.1:{port}", "in use", "--port")
    assert "broken.yaml" not in out


def test_a_rule_across_settings_is_one_line_naming_them(tmp_path: Path) -> None:
    out = refused(run(["serve", "--data-dir", str(tmp_path)], TIERGATE_QUOTA_LEASE_S="1"),
                  "TIERGATE_QUOTA_LEASE_S", "TIERGATE_QUOTA_REAP_EVERY_S")
    assert "setting  (" not in out and "(TIERGATE_)" not in out, out  # no empty setting name before the rule's text


def test_rollout_history_says_when_it_is_empty_and_names_a_misspelt_tier(tmp_path: Path) -> None:
    """It printed nothing for no changes, and nothing for `--tier mdi`: read as "no rollout ever" either way."""
    TenantStore(tmp_path / "state.db").close()  # a gateway started here
    out = run(["rollout", "history", "--data-dir", str(tmp_path)])
    assert out.exit_code == 0 and out.output.strip() == "no rollout changes", out.output
    out = run(["rollout", "history", "--tier", "mid", "--data-dir", str(tmp_path)])
    assert out.exit_code == 0 and out.output.strip() == "no rollout changes of tier mid", out.output
    refused(run(["rollout", "history", "--tier", "mdi", "--data-dir", str(tmp_path)]), "no tier 'mdi'", "mid")


def _commands(group: click.Group, path: str = "") -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = []
    for name, command in group.commands.items():
        out.append((f"{path} {name}".strip(), command))
        if isinstance(command, click.Group):
            out += _commands(command, f"{path} {name}")
    return out


@pytest.mark.parametrize(("path", "command"), _commands(cli), ids=[p for p, _ in _commands(cli)])
def test_every_command_and_option_says_what_it_does(path: str, command: click.Command) -> None:
    assert command.help and len(command.help.split()) >= 4, path
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            assert param.help, f"{path} {param.opts[0]} has no help"


@pytest.mark.parametrize(("path", "command"), _commands(cli), ids=[p for p, _ in _commands(cli)])
def test_every_option_says_its_default(path: str, command: click.Command) -> None:
    """What an option left out means (`keys issue --ttl`: never expires; `usage report --from`: the ledger's first
    day; a rollout guard: the tier's, else a number) is in its help, shown by click or written in words."""
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden and not param.is_flag and not param.required:
            words = (param.help or "").lower()
            assert param.show_default or "default" in words or "required" in words, \
                f"{path} {param.opts[0]}: its help does not say what leaving it out means"
