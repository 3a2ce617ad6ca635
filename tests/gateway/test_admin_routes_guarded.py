"""Every admin route, found in the app's own route table (not a list kept by hand: a route added later is checked
too), answers 401 without a key and 403 to a tenant's key, for each of its methods and for path tricks (trailing
slash, double slash, upper case), with nothing changed: an admin route left without its guard fails here."""

from __future__ import annotations

import re

import pytest

from tests.conftest import Gateway

ADMIN_PATHS = re.compile(r"^/admin(/|$)|^/metrics$")


def admin_routes(gateway: Gateway) -> list[tuple[str, str]]:
    """(method, path with its parameters filled) of every admin route the app serves."""
    found = []
    for route in gateway.app.routes:
        if not ADMIN_PATHS.match(route.path):
            continue
        path = re.sub(r"\{[^}]+\}", "acme", route.path)
        found += [(method, path) for method in sorted(route.methods) if method != "OPTIONS"]
    return found


def test_every_admin_route_refuses_a_missing_key_and_a_tenants_key(gateway: Gateway) -> None:
    routes = admin_routes(gateway)
    assert len(routes) >= 20  # the table was read: tenants, keys, degrade, rollouts, usage, ops, metrics
    tenants_before = sorted(t.name for t in gateway.store.list_tenants())
    with gateway.client(None) as anonymous, gateway.client(gateway.tenant_key) as tenant:
        for method, path in routes:
            body = {} if method == "POST" else None
            r = anonymous.request(method, path, json=body)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.json()["error"]["type"] in ("authentication_error", "invalid_request_error"), (method, path)
            r = tenant.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            for variant in (path + "/", "/" + path, path.upper()):
                r = tenant.request(method, variant, json=body)
                assert r.status_code in (403, 404, 405), (method, variant, r.status_code, r.text)
            if method == "GET":
                assert tenant.head(path).status_code in (403, 404, 405), path
    assert sorted(t.name for t in gateway.store.list_tenants()) == tenants_before  # nothing was changed


@pytest.mark.parametrize("key", ["Bearer", "x" * 10_000, "sk-tiergate-not-a-key"])
def test_malformed_keys_on_an_admin_route_are_refused_without_echoing_them(gateway: Gateway, key: str) -> None:
    with gateway.client(key) as c:
        r = c.get("/admin/tenants")
    assert r.status_code == 401 and key not in r.text


def test_every_tenant_route_refuses_a_missing_key(gateway: Gateway) -> None:
    """The OpenAI surface and /v1/usage, from the route table too: nothing is answered, counted or run without a
    key."""
    routes = [(m, re.sub(r"\{[^}]+\}", "x", r.path)) for r in gateway.app.routes if r.path.startswith("/v1/")
              for m in sorted(r.methods) if m != "OPTIONS"]
    assert len(routes) >= 5  # chat, completions, embeddings, models, usage
    with gateway.client(None) as anonymous:
        for method, path in routes:
            r = anonymous.request(method, path, json={} if method == "POST" else None)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
    assert gateway.ledger_rows() == [] and not gateway.stub.requests
