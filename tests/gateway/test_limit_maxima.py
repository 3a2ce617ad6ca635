"""A limit above what the quota backends count (quotas/plans.py MAX_*) is refused where an operator sets it: the CLI's
`keys issue` (a usage error naming the option), the admin API (400 naming `limits.<field>`) and the plans file (at
load, naming the file and the key). `tiergate keys issue --rpm 99999999999999999999999999` was taken, as was the
admin API's `rpm: 1e30` (read as 1000000000000000019884624838656) and a plan's `rpm: 10**400`, which Redis' scripts
read as infinity: no limit. A key stored before the maxima keeps its limits (listing it is no 500)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.config_files import ConfigFileError, load_yaml
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.plans import MAX_BUDGET_USD, MAX_CONCURRENT, MAX_RPM, MAX_TPM, Limits, PlanBook
from tests.conftest import Gateway

HUGE = "99999999999999999999999999"
# (option, field, the largest value, one above it)
FIELDS = [("--rpm", "rpm", MAX_RPM, MAX_RPM + 1), ("--tpm", "tpm", MAX_TPM, MAX_TPM + 1),
          ("--max-concurrent", "max_concurrent", MAX_CONCURRENT, MAX_CONCURRENT + 1),
          ("--budget-day", "budget_day_usd", MAX_BUDGET_USD, "9000000.000001"),
          ("--budget-month", "budget_month_usd", MAX_BUDGET_USD, "9000001")]


def _keys(data_dir: Path) -> list:  # type: ignore[type-arg]
    store = TenantStore(Settings(data_dir=data_dir).state_db)
    try:
        return store.list_keys()
    finally:
        store.close()


@pytest.mark.parametrize(("option", "given"), [("--rpm", HUGE), ("--rpm", str(10**400))]
                         + [(option, str(over)) for option, _, _, over in FIELDS])
def test_the_cli_refuses_a_limit_above_its_maximum_naming_the_option(tmp_path: Path, option: str,
                                                                     given: str) -> None:
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", option, given], env=env)
    assert r.exit_code == 2, r.output
    error = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and f"'{option}'" in error[0] and "at most" in error[0], r.output
    assert _keys(tmp_path) == []


def test_the_cli_takes_each_limit_at_its_maximum(tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    args = [arg for option, _, largest, _ in FIELDS for arg in (option, str(largest))]
    assert runner.invoke(cli, ["keys", "issue", "--tenant", "acme", *args], env=env).exit_code == 0
    (key,) = _keys(tmp_path)
    assert key.limits == Limits(**{field: largest for _, field, largest, _ in FIELDS})


def test_the_cli_names_the_option_of_a_negative_limit(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["keys", "issue", "--tenant", "acme", "--max-concurrent", "-1"],
                           env={"TIERGATE_DATA_DIR": str(tmp_path)})
    assert r.exit_code == 2 and "Invalid value for '--max-concurrent'" in r.output, r.output


@pytest.mark.parametrize(("field", "given"), [("rpm", 1e30), ("rpm", 10**400), ("rpm", 2**63)]
                         + [(field, over) for _, field, _, over in FIELDS] + [("budget_day_usd", 1e16)])
def test_the_admin_api_refuses_a_limit_above_its_maximum_by_name(gateway: Gateway, field: str, given: object) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": {field: given}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == f"limits.{field}" and "at most" in error["message"]
        assert error["type"] == "invalid_request_error"
        assert admin.get("/admin/keys").json()["data"] == before


def test_the_admin_api_takes_each_limit_at_its_maximum(gateway: Gateway) -> None:
    largest = {field: (str(value) if isinstance(value, Decimal) else value) for _, field, value, _ in FIELDS}
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": largest})
    assert r.status_code == 201, r.text
    assert r.json()["limits"] == largest


def test_a_key_stored_above_the_maxima_is_still_listed(gateway: Gateway) -> None:
    """Issued before the maxima (the store writes what it is given): it keeps its limits, and lists."""
    old = Limits.model_construct(rpm=10**30, budget_day_usd=Decimal(10**16))
    key, _ = gateway.store.issue_key("acme", limits=old)
    with gateway.client(gateway.admin_key) as admin:
        listed = admin.get("/admin/keys", params={"tenant": "acme"})
    assert listed.status_code == 200, listed.text
    assert {k["key_id"]: k["limits"] for k in listed.json()["data"]}[key.key_id] == {
        "rpm": 10**30, "budget_day_usd": "1" + "0" * 16}


@pytest.mark.parametrize(("field", "given"), [("rpm", str(10**400)), ("rpm", str(2**63))]
                         + [(field, f'"{over}"' if isinstance(over, str) else str(over))
                            for _, field, _, over in FIELDS])
def test_a_plans_file_with_a_limit_above_its_maximum_is_refused_at_load(tmp_path: Path, field: str,
                                                                        given: str) -> None:
    f = tmp_path / "plans.yaml"
    f.write_text("default_plan: p\nplans:\n  p:\n    allowed_tiers: [mid]\n    default_tier: mid\n"
                 f"    limits: {{{field}: {given}}}\n")
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, PlanBook)
    assert exc.value.path == f and exc.value.line == 6
    assert f"plans.p.limits.{field}: Input should be at most" in exc.value.reason, exc.value.reason
