"""A tenant created with `plan: ""` is refused by name (400 plan_not_found), and no tenant is created: the empty name
was read as no plan, and the tenant created on the default plan, which the caller had not asked for. Left out or
null, the plan is the default."""

from __future__ import annotations

from tests.conftest import Gateway


def test_an_empty_plan_is_refused_and_creates_no_tenant(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/tenants", json={"name": "beta", "plan": ""})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("plan", "plan_not_found")
        assert "beta" not in {t["name"] for t in admin.get("/admin/tenants").json()["data"]}

        assert admin.post("/admin/tenants", json={"name": "beta", "plan": None}).json()["plan"] == "standard"
        assert admin.post("/admin/tenants", json={"name": "gamma"}).json()["plan"] == "standard"
