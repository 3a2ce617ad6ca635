"""The CLI acts on the same state as a running gateway, at once."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from gateway.tenants.store_sqlite import FOLLOW_EVERY_S
from quotas.ledger import Ledger
from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]


def test_cli_tenants_keys_and_usage_against_a_running_gateway(gateway: Gateway) -> None:
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(gateway.settings.data_dir),
           "TIERGATE_PLANS_FILE": str(gateway.settings.plans_file)}
    r = runner.invoke(cli, ["tenants", "create", "initech"], env=env)
    assert r.exit_code == 0 and "plan standard" in r.output
    assert runner.invoke(cli, ["tenants", "create", "initech"], env=env).exit_code == 1
    assert "initech" in runner.invoke(cli, ["tenants", "list"], env=env).output
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "initech"], env=env)
    assert r.exit_code == 0
    key = next(line.split()[-1] for line in r.output.splitlines() if line.startswith("key    :"))
    key_id = next(line.split()[-1] for line in r.output.splitlines() if line.startswith("key id"))
    with gateway.client(key) as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
        r = runner.invoke(cli, ["keys", "rotate", key_id], env=env)
        assert r.exit_code == 0
        time.sleep(FOLLOW_EVERY_S)  # the gateway reads the store's change counter at most this often
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
    new_key = next(line.split()[-1] for line in r.output.splitlines() if line.startswith("key    :"))
    with gateway.client(new_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
        new_id = new_key[3:15]
        assert runner.invoke(cli, ["keys", "revoke", new_id], env=env).exit_code == 0
        time.sleep(FOLLOW_EVERY_S)
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
    listed = runner.invoke(cli, ["keys", "list", "--tenant", "initech"], env=env).output
    assert "revoked" in listed and key not in listed
    usage = json.loads(runner.invoke(cli, ["usage", "report", "--format", "json"], env=env).output)
    assert usage[0]["tenant"] == "initech" and usage[0]["requests"] == 2
    table = runner.invoke(cli, ["usage"], env=env).output
    assert "initech" in table and "price_per_1k_usd" in table


def test_cli_usage_errors_are_clear(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    r = runner.invoke(cli, ["keys", "issue"], env=env)
    assert r.exit_code == 2 and "--tenant" in r.output
    TenantStore(tmp_path / "state.db").close()  # a gateway started here (on none, a key is refused before any tenant)
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "ghost"], env=env)
    assert r.exit_code == 1 and "no tenant 'ghost'" in r.output
    r = runner.invoke(cli, ["tenants", "create", "x", "--plan", "gold"], env=env)
    assert r.exit_code == 1 and "no plan 'gold'" in r.output


def _issued_id(output: str) -> str:
    return next(line.split()[-1] for line in output.splitlines() if line.startswith("key id"))


def test_cli_refuses_tenant_admin_keys_and_unbounded_lifetimes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", "--admin"], env=env)
    assert r.exit_code == 2 and "admin key cannot belong to a tenant" in r.output
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "", "--admin"], env=env)
    assert r.exit_code == 2 and "admin key cannot belong to a tenant" in r.output
    for ttl in ("nan", "inf", "-5", "0", "0s", "1e9", "3651d", "30x", ""):
        r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", f"--ttl={ttl}"], env=env)
        assert r.exit_code == 2 and "--ttl" in r.output, (ttl, r.output)
    key_id = _issued_id(runner.invoke(cli, ["keys", "issue", "--tenant", "acme"], env=env).output)
    for option in ("--ttl=nan", "--ttl=0", "--grace=inf", "--grace=-1", "--grace=8d"):
        r = runner.invoke(cli, ["keys", "rotate", key_id, option], env=env)
        assert r.exit_code == 2 and option.split("=")[0] in r.output, (option, r.output)
    store = TenantStore(Settings(data_dir=tmp_path).state_db)
    try:
        assert [k.key_id for k in store.list_keys()] == [key_id] and store.get_key(key_id).revoked_at is None
    finally:
        store.close()


def test_cli_rotation_never_extends_a_key_life(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", "--ttl", "2d"], env=env)
    assert r.exit_code == 0 and "expires: never" not in r.output
    old_id = _issued_id(r.output)
    r = runner.invoke(cli, ["keys", "rotate", old_id, "--ttl", "30d", "--grace", "7d"], env=env)
    assert r.exit_code == 0
    new_id = _issued_id(r.output)
    forever_id = _issued_id(runner.invoke(cli, ["keys", "issue", "--tenant", "acme"], env=env).output)
    given_id = _issued_id(runner.invoke(cli, ["keys", "rotate", forever_id, "--ttl", "1h"], env=env).output)
    store = TenantStore(Settings(data_dir=tmp_path).state_db)
    try:
        old, new, given = store.get_key(old_id), store.get_key(new_id), store.get_key(given_id)
        assert new.expires_at == old.expires_at and old.expires_at <= old.created_at + 2 * 86400
        assert given.expires_at is not None and given.expires_at <= given.created_at + 3600
    finally:
        store.close()


def test_cli_keys_list_shows_a_rotated_key_going_away(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """After `keys rotate --grace 1h`, `keys list` said only "active" of the old key: not that it expires within the
    hour, nor which key replaced it."""
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    old_id = _issued_id(runner.invoke(cli, ["keys", "issue", "--tenant", "acme"], env=env).output)
    rotated = runner.invoke(cli, ["keys", "rotate", old_id, "--grace", "1h"], env=env)
    new_id = _issued_id(rotated.output)
    rows = {line.split("\t")[0]: line.split("\t") for line in
            runner.invoke(cli, ["keys", "list"], env=env).output.splitlines()}
    store = TenantStore(Settings(data_dir=tmp_path).state_db)
    try:
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(store.get_key(old_id).expires_at))
    finally:
        store.close()
    assert rows[old_id][1:] == ["acme", "active", "", until, new_id]
    assert f"old key {old_id}: works until {until} (--grace)" in rotated.output, rotated.output  # its deadline
    other = _issued_id(runner.invoke(cli, ["keys", "issue", "--tenant", "acme"], env=env).output)
    assert f"old key {other}: revoked" in runner.invoke(cli, ["keys", "rotate", other], env=env).output
    assert rows[new_id][1:] == ["acme", "active", "", "never", "-"]



def test_cli_csv_report_of_no_use_has_its_header(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    Ledger(tmp_path / "ledger.db").close()  # a gateway started here (it makes its ledger) and served nothing
    r = runner.invoke(cli, ["usage", "report", "--by", "tenant,day", "--format", "csv"], env=env)
    assert r.exit_code == 0 and r.output.startswith("tenant,day,requests,input_tokens,"), r.output
    assert r.output.count("\n") == 1, r.output



def test_cli_refuses_limits_on_an_admin_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`keys issue --admin --rpm 5 --budget-day 3` issued an admin key whose limits never applied: it calls no model."""
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    r = runner.invoke(cli, ["keys", "issue", "--admin", "--rpm", "5", "--budget-day", "3"], env=env)
    assert r.exit_code == 2 and "--rpm, --budget-day: an admin key calls no models" in r.output, r.output
    assert "key id" not in r.output and not (tmp_path / "state.db").exists()
