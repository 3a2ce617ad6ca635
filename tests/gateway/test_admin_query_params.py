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


REPEATED = [  # (key, path, query with one parameter twice): every route that takes a query, the parameter it takes
    ("admin", "/admin/usage/report", [("tenant", "acme"), ("tenant", "globex")]),
    ("admin", "/admin/usage/report", [("by", "tier"), ("from", "2026-01-01"), ("by", "tenant")]),
    ("admin", "/admin/usage/report", [("format", "json"), ("format", "csv")]),
    ("admin", "/admin/keys", [("tenant", "acme"), ("tenant", "globex")]),
    ("admin", "/admin/degrade/history", [("limit", "1"), ("limit", "2")]),
    ("admin", "/admin/rollouts/history", [("tier", "mid"), ("tier", "small")]),
    ("tenant", "/v1/usage", [("to", "2026-01-01"), ("to", "2026-12-31")]),
    ("tenant", "/v1/usage", [("by", "tier"), ("by", "tier")]),  # the same value twice too: one value each
]


def test_a_parameter_sent_twice_is_refused_by_name_not_one_of_its_values_used(gateway: Gateway) -> None:
    """`?tenant=acme&tenant=globex` reported on one of the two, whichever Litestar took, with a 200: a report of
    another tenant than finance read in its own URL. Each of these parameters takes one value."""
    gateway.store.create_tenant("globex", "standard")
    keys = {"admin": gateway.admin_key, "tenant": gateway.tenant_key}
    for who, path, query in REPEATED:
        with gateway.client(keys[who]) as c:
            r = c.get(path, params=query)
            assert r.status_code == 400, (path, query, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, r.text
            named = next(name for i, (name, _) in enumerate(query) if name in {n for n, _ in query[:i]})
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error", named, "duplicate_parameter"), (path, query, r.text)
            assert named in error["message"] and "globex" not in error["message"], r.text
            assert c.get(path, params=query[:1]).status_code == 200, (path, query[:1])  # once is fine
