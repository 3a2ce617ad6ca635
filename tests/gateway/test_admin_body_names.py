"""A name in an admin route's body that does not exist is a 400 in OpenAI's shape naming that field, and changes
nothing: a key issued for a tenant the store does not have (`POST /admin/keys`), a tenant on a plan there is none of
(`POST /admin/tenants`). The key's was a 404, as if the route did not exist; the route exists and the name is bad
input in the body, as a canary's tenants are (tests/gateway/test_rollout_named_tenants.py). A tenant or key in the
path stays a 404."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Gateway

NOT_TENANTS = ["nobody", "Acme", "acme ", "acme\n", "a*", "", "x" * 300]


def refused(r: httpx.Response, param: str, code: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    assert len(error["message"]) < 300, error  # a 300-character name is not echoed whole
    return error


def test_a_key_for_a_tenant_that_does_not_exist_is_a_400_naming_tenant(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        for name in NOT_TENANTS:
            for extra in ({}, {"name": "svc", "ttl_s": 60}, {"limits": {"rpm": 5}}):
                error = refused(admin.post("/admin/keys", json={"tenant": name, **extra}), "tenant",
                                "tenant_not_found")
                assert repr(name[:64]) in error["message"], error
        assert admin.get("/admin/keys").json()["data"] == before  # no key was made
        assert admin.post("/admin/keys", json={"tenant": "acme"}).status_code == 201  # the route works
        assert admin.post("/admin/keys/000000000000/revoke").status_code == 404  # a key in the path: a 404
        assert admin.post("/admin/tenants/nobody/data-version").status_code == 404  # a tenant in the path


def test_a_tenant_on_a_plan_that_does_not_exist_is_a_400_naming_plan(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/tenants").json()["data"]
        for plan in ("gold", "Standard", "x" * 300):
            error = refused(admin.post("/admin/tenants", json={"name": "globex", "plan": plan}), "plan",
                            "plan_not_found")
            assert "standard" in error["message"], error  # it says which plans there are
        assert admin.get("/admin/tenants").json()["data"] == before
