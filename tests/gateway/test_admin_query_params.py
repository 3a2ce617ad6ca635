"""An admin route refuses a query parameter it does not take, by name, and changes nothing; it was ignored, and the
route answered something else than asked: a misspelt `?tenant=` listed every tenant's keys, and a grace period put in
the query of a rotation revoked the old key at once. A tenant's key still gets the 403, whatever the query."""

from __future__ import annotations

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]


def test_a_misspelt_filter_is_refused_not_answered_with_every_tenants_keys(gateway: Gateway) -> None:
    gateway.store.create_tenant("globex", "standard")
    gateway.store.issue_key("globex", name="theirs")
    with gateway.client(gateway.admin_key) as admin:
        r = admin.get("/admin/keys", params={"tenat": "acme"})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("tenat", "unsupported_parameter")
        ours = admin.get("/admin/keys", params={"tenant": "acme"})
        assert ours.status_code == 200 and {k["tenant"] for k in ours.json()["data"]} == {"acme"}


def test_a_grace_period_in_the_query_is_refused_and_the_key_is_not_rotated(gateway: Gateway) -> None:
    key_id = gateway.tenant_key.split("-")[1]
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post(f"/admin/keys/{key_id}/rotate", params={"grace_s": "3600"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grace_s", r.text
        assert len(admin.get("/admin/keys", params={"tenant": "acme"}).json()["data"]) == 1
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}).status_code == 200


def test_every_admin_route_refuses_an_unknown_parameter_and_a_tenant_still_gets_403(gateway: Gateway) -> None:
    routes = [("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("POST", "/admin/tenants/acme/data-version"),
              ("POST", "/admin/keys"), ("POST", "/admin/keys/000000000000/revoke"), ("GET", "/admin/degrade/"),
              ("POST", "/admin/degrade/auto"), ("GET", "/admin/degrade/history"), ("POST", "/admin/degrade/"),
              ("GET", "/admin/rollouts/"), ("GET", "/admin/rollouts/history"), ("GET", "/admin/ops")]
    with gateway.client(gateway.admin_key) as admin, gateway.client(gateway.tenant_key) as tenant:
        level = admin.get("/admin/degrade/").json()["level"]
        for method, path in routes:
            r = admin.request(method, path, params={"x": "1"}, json={} if method == "POST" else None)
            assert r.status_code == 400 and r.json()["error"]["param"] == "x", (method, path, r.text)
            assert tenant.request(method, path, params={"x": "1"}).status_code == 403, (method, path)
        assert admin.get("/admin/degrade/history", params={"limit": 1}).status_code == 200
        assert admin.get("/admin/rollouts/history", params={"tier": "mid", "limit": 1}).status_code == 200
        assert admin.get("/admin/degrade/").json()["level"] == level
        assert admin.get("/admin/degrade/history").json()["data"] == []
        assert {t["name"] for t in admin.get("/admin/tenants").json()["data"]} == {"acme"}
