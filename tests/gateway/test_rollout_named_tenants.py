"""A canary's named tenants must exist: a name the tenant store does not have is a 400 `tenant_not_found` naming
its place (`tenants.1`) from the admin API, and a refusal from the CLI, and no rollout starts. Both were taken, and
the canary started with a misspelt tenant that no request ever matches, while the tenant meant stayed on the old
version. A 400, not the 404 it was: the route exists, and the name is bad input in the body."""

from __future__ import annotations

from click.testing import CliRunner

from gateway.cli.main import cli
from tests.conftest import Gateway
from tests.gateway.test_rollout import admin, servers, tenant_key, two_versions  # noqa: F401 (fixtures)
from tests.stubs import StubState


def test_a_canary_naming_a_tenant_that_does_not_exist_is_refused(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:  # noqa: F811
    gw, _, _ = two_versions
    tenant_key(gw, "vip")
    for tenants, place in ((["vip", "vlp"], "tenants.1"), (["vip.x"], "tenants.0"), (["ghost"], "tenants.0")):
        r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.0, "tenants": tenants,
                                          "reason": "vip tries it"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (place, "tenant_not_found", "invalid_request_error")
        assert set(error) == {"message", "type", "param", "code"} and place in error["message"], error
    assert admin(gw, "/admin/rollouts").json()["data"] == []
    assert admin(gw, "/admin/rollouts/history").json()["data"] == []
    where = ["--data-dir", str(gw.settings.data_dir), "--tiers", str(gw.settings.tiers_file)]
    run = CliRunner().invoke(cli, ["rollout", "start", "mid", "v2", "--tenant", "vip", "--tenant", "vlp",
                                   "--reason", "from the cli", *where])
    assert run.exit_code == 1 and "no tenant 'vlp'" in run.output, run.output
    assert admin(gw, "/admin/rollouts/history").json()["data"] == []
    named = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "tenants": ["vip"], "reason": "vip"})
    assert named.status_code == 201 and named.json()["tenants"] == ["vip"], named.text
