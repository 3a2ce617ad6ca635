"""A tenant on a plan this gateway's plans file lacks: start-up refuses it, and a request that meets one all the same
(a tenant moved by a CLI with another plans file) is a 503 that says so, not a 500, and charges nothing."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from gateway.app import create_app
from gateway.cli.main import cli
from gateway.config_files import ConfigFileError
from gateway.settings import Settings
from gateway.stores import open_tenant_store
from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hello there"}]


def test_a_request_of_a_tenant_whose_plan_is_missing_is_a_503_that_says_so(gateway: Gateway,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    gateway.store.create_tenant("other", "standard")
    _, other_key = gateway.store.issue_key("other", name="k")
    gateway.store.set_plan("acme", "gold")  # as `tiergate admin tenants set-plan acme gold --plans NEWER_FILE` does
    asks = [("POST", "/v1/chat/completions", {"model": "mid", "messages": MSG}),
            ("POST", "/v1/completions", {"model": "mid", "prompt": "hello"}),
            ("POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hello"}),
            ("GET", "/v1/models", None), ("GET", "/v1/models/mid", None)]
    with gateway.client(gateway.tenant_key) as c, caplog.at_level("ERROR"):
        deadline = time.time() + 10  # the gateway follows the store's change within a second
        while (r := c.post("/v1/chat/completions", json=asks[0][2])).status_code == 200 and time.time() < deadline:
            time.sleep(0.1)
        billed = len([row for row in gateway.ledger_rows() if row.tenant == "acme"])
        for method, path, body in asks:
            r = c.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.json() == {"error": {
                "message": "your tenant's plan 'gold' is not configured on this gateway; its operator has been told "
                           "(nothing was charged)", "type": "service_unavailable", "param": None,
                "code": "plan_not_configured"}}
    assert len([row for row in gateway.ledger_rows() if row.tenant == "acme"]) == billed
    told = [r for r in caplog.records if "plan 'gold'" in r.getMessage()]
    assert len(told) == 1 and not [r for r in caplog.records if r.exc_info]  # once, and no traceback
    with gateway.client(other_key) as c:  # the other tenants are served as before
        assert c.post("/v1/chat/completions", json=asks[0][2]).status_code == 200


def test_start_up_refuses_a_plans_file_without_a_plan_tenants_are_on(gateway_settings: Settings,
                                                                     prepared_models) -> None:  # type: ignore[no-untyped-def]
    store = open_tenant_store(gateway_settings)
    for i in range(7):
        store.create_tenant(f"t{i}", "legacy")
    store.create_tenant("solo", "retired")
    store.create_tenant("fine", "standard")
    store.close()
    with pytest.raises(ConfigFileError) as exc:
        create_app(gateway_settings)
    assert exc.value.path == gateway_settings.plans_file
    assert exc.value.reason.startswith("tenants are on plans this file does not have: 'legacy' (tenants t0, t1, t2, "
                                       "t3, t4 and 2 more); 'retired' (tenant solo); add the plans back")
    s = gateway_settings
    r = CliRunner().invoke(cli, ["serve", "--tiers", str(s.tiers_file), "--plans", str(s.plans_file),
                                 "--models-dir", str(prepared_models), "--data-dir", str(s.data_dir)])
    assert r.exit_code == 1 and "'legacy' (tenants t0, t1, t2, t3, t4 and 2 more)" in r.output, r.output
    assert str(s.plans_file) in r.output
