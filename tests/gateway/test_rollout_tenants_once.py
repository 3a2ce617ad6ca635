"""A canary naming a tenant twice is a 400 naming the repeat's place (`tenants.1`, `duplicate_tenant`) from the admin
API, and a refusal from the CLI; no rollout starts. The repeat was dropped in silence, with a 201."""

from __future__ import annotations

from click.testing import CliRunner

from gateway.cli.main import cli
from tests.conftest import Gateway
from tests.gateway.test_rollout import admin, servers, tenant_key, two_versions  # noqa: F401 (fixtures)
from tests.stubs import StubState


def test_a_tenant_named_twice_is_refused_by_name_and_nothing_starts(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:  # noqa: F811
    gw, _, _ = two_versions
    tenant_key(gw, "vip")
    tenant_key(gw, "other")
    for tenants, place in ((["vip", "vip"], "tenants.1"), (["vip", "other", "vip"], "tenants.2")):
        r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.1, "tenants": tenants,
                                          "reason": "twice"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert (error["param"], error["code"], error["type"]) == (place, "duplicate_tenant", "invalid_request_error")
        assert place in error["message"] and "'vip'" in error["message"], error
    where = ["--data-dir", str(gw.settings.data_dir), "--tiers", str(gw.settings.tiers_file)]
    run = CliRunner().invoke(cli, ["rollout", "start", "mid", "v2", "--tenant", "vip", "--tenant", "vip",
                                   "--reason", "from the cli", *where])
    assert run.exit_code == 1 and "tenants.1" in run.output, run.output
    assert admin(gw, "/admin/rollouts").json()["data"] == []
    assert admin(gw, "/admin/rollouts/history").json()["data"] == []
    tenants = admin(gw, "/openapi.json").json()["components"]["schemas"]["StartRollout"]["properties"]["tenants"]
    assert tenants["uniqueItems"] is True, tenants  # the document says each is named once
