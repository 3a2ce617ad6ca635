"""Admin routes need an admin key; tenants and keys made there work at once; /metrics counts."""

from __future__ import annotations

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]


def test_admin_routes_refuse_tenant_and_missing_keys(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for method, path in [("GET", "/admin/tenants"), ("POST", "/admin/keys"), ("GET", "/admin/usage/report"),
                             ("GET", "/metrics")]:
            r = c.request(method, path, json={})
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", path
    with gateway.client() as c:
        assert c.get("/admin/tenants").status_code == 401


def test_tenant_and_key_lifecycle_through_the_api(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/tenants", json={"name": "globex", "plan": "smallonly"})
        assert r.status_code == 201 and r.json()["plan"] == "smallonly"
        assert admin.post("/admin/tenants", json={"name": "globex"}).status_code == 409
        assert admin.post("/admin/tenants", json={"name": "x", "plan": "gold"}).status_code == 400
        assert admin.post("/admin/tenants", json={"name": 5}).status_code == 400
        r = admin.post("/admin/keys", json={"tenant": "acme", "name": "svc"})
        assert r.status_code == 201
        issued = r.json()
        key, key_id = issued["key"], issued["key_id"]
        assert admin.post("/admin/keys", json={"tenant": "nobody"}).status_code == 400
        listed = admin.get("/admin/keys", params={"tenant": "acme"}).json()["data"]
        assert key_id in {k["key_id"] for k in listed} and all("key" not in k for k in listed)
        with gateway.client(key) as c:
            assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
            r = admin.post(f"/admin/keys/{key_id}/rotate", json={"grace_s": 0})
            assert r.status_code == 201 and r.json()["replaces"] == key_id
            assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
        with gateway.client(r.json()["key"]) as c:
            assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
            admin.post(f"/admin/keys/{r.json()['key_id']}/revoke")
            assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
        assert admin.post("/admin/keys/000000000000/revoke").status_code == 404
        usage = admin.get("/admin/usage/report").json()["data"]
        assert [(u["tenant"], u["tier"], u["requests"], u["input_tokens"], u["output_tokens"]) for u in usage] == [
            ("acme", "mid", 2, 2, 12)]


def test_metrics_count_requests_tokens_and_cost(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json={"model": "full", "messages": MSG}).status_code == 200
        assert c.post("/v1/chat/completions", json={"model": "nope", "messages": MSG}).status_code == 404
    with gateway.client(gateway.admin_key) as admin:
        text = admin.get("/metrics").text
    assert 'tiergate_requests_total{status="ok",tenant="acme",tier="full"} 3.0' in text
    assert 'tiergate_tokens_total{kind="output",tenant="acme",tier="full"} 18.0' in text
    assert 'tiergate_refusals_total{reason="model_not_found"} 1.0' in text
    assert 'tiergate_time_to_first_token_seconds_count{tier="full"} 3.0' in text
    assert "tiergate_gateway_overhead_seconds_count 3.0" in text
    assert 'tiergate_tier_replicas_ready{tier="small"} 0.0' in text
    assert 'tiergate_price_usd_total{tenant="acme",tier="full"}' in text


def test_health_says_only_ready_or_not_without_an_admin_key(gateway: Gateway) -> None:
    # small points at a dead URL: it is down (not merely unbuilt), so the gateway is not fully ready
    for key in (None, gateway.tenant_key, "tg-000000000000-wrong"):
        with gateway.client(key) as c:
            r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "starting"}), key
        assert "small" not in r.text and "mid" not in r.text
    with gateway.client(gateway.admin_key) as c:
        r = c.get("/health")
    body = r.json()
    assert r.status_code == 503 and body["status"] == "starting"
    assert body["tiers"]["mid"]["ready"] and not body["tiers"]["small"]["ready"]
    assert "small" in body["not_ready"] and body["not_ready"]["small"]


def test_an_admin_key_cannot_belong_to_a_tenant(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        r = admin.post("/admin/keys", json={"tenant": "acme", "admin": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
        assert "admin key cannot belong to a tenant" in r.json()["error"]["message"]
        assert admin.get("/admin/keys").json()["data"] == before  # nothing was issued


def test_an_admin_key_with_limits_is_refused(gateway: Gateway) -> None:
    """An admin key calls no model: `{"admin": true, "limits": {"rpm": 5}}` issued a key whose limits never applied."""
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        r = admin.post("/admin/keys", json={"admin": True, "limits": {"rpm": 5}})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("limits", "admin_key_with_limits")
        assert admin.get("/admin/keys").json()["data"] == before  # nothing was issued
        assert admin.post("/admin/keys", json={"admin": True, "limits": {}}).status_code == 201


NON_FINITE = (b"NaN", b"Infinity")


def test_key_lifetimes_are_finite_positive_and_bounded(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        key_id = admin.post("/admin/keys", json={"tenant": "acme"}).json()["key_id"]
        for ttl in (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1", b"0", b"1e300", b'"30d"', b"true"):
            for path, body in (("/admin/keys", b'{"tenant": "acme", "ttl_s": '),
                               (f"/admin/keys/{key_id}/rotate", b'{"ttl_s": ')):
                r = admin.post(path, content=body + ttl + b"}", headers={"content-type": "application/json"})
                error = r.json()["error"]
                assert r.status_code == 400, (path, ttl, r.text)  # non-finite literals are not JSON (RFC 8259)
                assert error["param"] == "ttl_s" or (ttl.lstrip(b"-") in NON_FINITE and error["code"] == "invalid_json")
        for grace in (b"NaN", b"Infinity", b"-1", b"1e9"):
            r = admin.post(f"/admin/keys/{key_id}/rotate", content=b'{"grace_s": ' + grace + b"}",
                           headers={"content-type": "application/json"})
            error = r.json()["error"]
            assert r.status_code == 400, (grace, r.text)
            assert error["param"] == "grace_s" or (grace in NON_FINITE and error["code"] == "invalid_json")
        listed = admin.get("/admin/keys", params={"tenant": "acme"}).json()["data"]
        assert listed[-1]["key_id"] == key_id and listed[-1]["revoked_at"] is None  # no refused call left a trace
        r = admin.post("/admin/keys", json={"tenant": "acme", "ttl_s": 86400})
        assert r.status_code == 201 and 86390 < r.json()["expires_at"] - r.json()["created_at"] <= 86400


def test_rotation_never_extends_a_key_life(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        old = admin.post("/admin/keys", json={"tenant": "acme", "ttl_s": 2 * 86400}).json()
        r = admin.post(f"/admin/keys/{old['key_id']}/rotate", json={"ttl_s": 30 * 86400, "grace_s": 7 * 86400})
        new = r.json()
        assert r.status_code == 201 and new["expires_at"] == old["expires_at"]
        # the grace period keeps the old key working, but not past its own end
        listed = {k["key_id"]: k for k in admin.get("/admin/keys", params={"tenant": "acme"}).json()["data"]}
        assert listed[old["key_id"]]["expires_at"] <= old["expires_at"]
        shorter = admin.post(f"/admin/keys/{new['key_id']}/rotate", json={"ttl_s": 3600}).json()
        assert shorter["expires_at"] <= shorter["created_at"] + 3600
        forever = admin.post("/admin/keys", json={"tenant": "acme"}).json()
        assert forever["expires_at"] is None
        given = admin.post(f"/admin/keys/{forever['key_id']}/rotate", json={"ttl_s": 600}).json()
        assert given["expires_at"] is not None and given["expires_at"] <= given["created_at"] + 600
        kept = admin.post(f"/admin/keys/{given['key_id']}/rotate").json()
        assert kept["expires_at"] == given["expires_at"]


def test_data_version_bump_route(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        assert admin.post("/admin/tenants/acme/data-version").json() == {"tenant": "acme", "data_version": 1}
        assert admin.post("/admin/tenants/acme/data-version").json()["data_version"] == 2
        assert admin.post("/admin/tenants/nobody/data-version").status_code == 404
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/admin/tenants/acme/data-version").status_code == 403
