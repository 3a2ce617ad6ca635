"""A key's name is one line: a tab, newline or other control character in it is a 400 naming `name` (the admin API)
or a refusal (the CLI), and no key is issued. It was taken, and `tiergate keys list`, a tab-separated table, printed
a name holding "\\n<id>\\t<tenant>\\tactive" as a row for a key that does not exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.errors import InvalidRequest
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from tests.conftest import Gateway

FORGED = "ci\nffffffffffff\tglobex\tactive\tprod"  # a second row of `keys list`
BAD_NAMES = [FORGED, "a\tb", "a\rb", "nul\x00", "esc\x1b[31m", "del\x7f", "nel\x85", "line\u2028sep", "x" * 129]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenantStore]:
    s = TenantStore(Settings(data_dir=tmp_path).state_db)
    s.create_tenant("acme", "standard")
    yield s
    s.close()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_store_refuses_a_name_that_is_not_one_line(store: TenantStore, name: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        store.issue_key("acme", name=name)
    assert (exc.value.param, exc.value.code) == ("name", "invalid_value")
    assert store.list_keys() == []


def test_names_on_one_line_are_kept_as_given(store: TenantStore) -> None:
    for name in ("", "ci runner #3", "clé de prod", "x" * 128):
        key, _ = store.issue_key("acme", name=name)
        assert store.get_key(key.key_id).name == name


def test_a_key_named_before_the_rule_rotates_to_a_one_line_name(store: TenantStore) -> None:
    key, _ = store.issue_key("acme", name="old")
    store._execute("UPDATE api_keys SET name = ? WHERE key_id = ?", ("line one\nline\ttwo", key.key_id))
    new, _ = store.rotate_key(key.key_id)
    assert new.name == "line one line two"


def test_the_admin_api_refuses_it_and_issues_nothing(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        for name in BAD_NAMES:
            r = admin.post("/admin/keys", json={"tenant": "acme", "name": name})
            assert r.status_code == 400, (name, r.text)
            assert (r.json()["error"]["param"], r.json()["error"]["type"]) == ("name", "invalid_request_error")
        assert admin.get("/admin/keys").json()["data"] == before


def test_the_cli_refuses_it_and_lists_one_row_a_key(tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", "--name", FORGED], env=env)
    assert r.exit_code == 1 and "name" in r.output and "key id" not in r.output, r.output
    assert runner.invoke(cli, ["keys", "issue", "--tenant", "acme", "--name", "ci"], env=env).exit_code == 0
    listed = runner.invoke(cli, ["keys", "list"], env=env).output.splitlines()
    assert len(listed) == 1 and listed[0].split("\t")[1:] == ["acme", "active", "ci", "never", "-"], listed
