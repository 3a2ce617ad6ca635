"""Every route of the app's own route table is public, a tenant's, or an admin's, and nothing else: the first two are
allow-listed below, each with why, and every other route (whatever its path: a route added later under /v1, /cache
or anywhere, without `require_admin`, fails here) refuses a missing key with 401 and a tenant's key with 403, as it
does a revoked or expired admin key and a malformed Authorization header, in OpenAI's error shape, revealing nothing
and changing nothing. An admin key is accepted whatever the case of its scheme (RFC 9110: the scheme is
case-insensitive), and every admin route refuses a query parameter it does not take rather than ignoring it."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.auth import require_admin
from gateway.settings import Settings
from gateway.tenants.records import ADMIN
from tests.conftest import PLANS_YAML, Gateway, running_gateway, tiers_yaml
from tests.stubs import ServerThread, StubState, free_port, stub_app

# Routes any caller may read without a key
PUBLIC = {
    # a load balancer's probe needs no key; only an admin key sees why the gateway is not ready
    # (tests/gateway/test_admin_api.py's test_health_says_only_ready_or_not_without_an_admin_key)
    ("GET", "/health"),
    # a static page (HTML, CSS, script) holding no data: it reads everything through the admin API with the admin key
    # its user types (gateway/routes/dashboard.py)
    ("GET", "/dashboard"),
    # the published OpenAPI document and its reference page: what each route takes and answers, the same for every
    # deployment (built from the code), never a tenant, key, tier state or figure of this one
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/openapi.json"), ("GET", "/docs/{path:str}"),
}
# Routes for any valid key, and 401 without one; what each shows depends on the key (tested where each route is)
TENANT = {
    # a tenant's key calls models (an admin key gets 403 tenant_key_required)
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
    # the models the key's plan allows; an admin key sees every tier (gateway/routes/models.py)
    ("GET", "/v1/models"), ("GET", "/v1/models/{model_id:str}"),
    # the caller's own tenant's usage only; `?tenant=` is refused (test_a_tenant_cannot_ask_for_another_tenants_usage)
    ("GET", "/v1/usage"),
}
# Litestar answers OPTIONS itself on every path with the `Allow` header alone (no handler of ours runs, nothing is
# read). On a public or tenant path it needs no key: the methods of a route, which the public OpenAPI document lists
# anyway. On every other path it is an admin route like the path's other methods, walked below: it was answered 204
# without a key on /metrics, /admin/ops and /admin/usage/report (the automatic handler takes the guards of the
# route's owner, and those three had their guards on the handler alone). No CORS preflight is granted anyway
# (tests/gateway/test_cors.py), so a browser's preflight, which sends no key, loses nothing there.
OPEN_OPTIONS = {("OPTIONS", path) for _, path in PUBLIC | TENANT}

# values for path parameters: real names, so that a route answering without its guard would change something real
PATH_VALUES = {"name": "acme", "tier": "mid"}  # `key_id`: the tenant key's id, filled in by `_path`
# bodies that would change state if a route took them (one creating a tenant, issuing a key, setting a level...)
BODIES = {
    "/admin/tenants": {"name": "intruder"},
    "/admin/keys": {"tenant": "acme", "name": "stolen"},
    "/admin/degrade": {"level": 1, "reason": "forged"},
    "/admin/rollouts": {"tier": "mid", "version": "v2", "share": 1.0, "reason": "forged"},
    "/admin/rollouts/{tier:str}/promote": {"reason": "forged"},
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
HIDDEN = "zq7-hidden-tenant"  # a tenant of the gateway below that nothing public may name


def _route_table() -> list[tuple[str, str, Any]]:
    """(method, path template, handler) of every route the app serves, read from Litestar's own table."""
    with tempfile.TemporaryDirectory() as data_dir:
        app = create_app(Settings(data_dir=Path(data_dir)))
    return sorted(((method, route.path, handler) for route in app.routes for handler in route.route_handlers
                   for method in handler.http_methods), key=lambda r: r[:2])


TABLE = _route_table()
ADMIN_ROUTES = [(method, path) for method, path, _ in TABLE if (method, path) not in PUBLIC | TENANT | OPEN_OPTIONS]


def test_the_allow_lists_name_only_routes_the_app_serves() -> None:
    """A stale entry (a route renamed or gone) would let its successor fall to the admin checks unnoticed, or hide
    that the table was not read; every route is in exactly one class."""
    served = {(method, path) for method, path, _ in TABLE}
    assert not (PUBLIC | TENANT | OPEN_OPTIONS) - served, (PUBLIC | TENANT | OPEN_OPTIONS) - served
    assert len(ADMIN_ROUTES) >= 20  # tenants, keys, degrade, rollouts, usage, ops, metrics
    # OPTIONS is walked on every admin path: /metrics, /admin/ops and /admin/usage/report among them
    assert {path for method, path in ADMIN_ROUTES if method == "OPTIONS"} == {path for _, path in ADMIN_ROUTES}


@pytest.mark.parametrize(("method", "path", "handler"), [r for r in TABLE if r[:2] in ADMIN_ROUTES],
                         ids=[f"{m} {p}" for m, p, _ in TABLE if (m, p) in ADMIN_ROUTES])
def test_every_other_route_has_the_admin_guard(method: str, path: str, handler: Any) -> None:
    """Read from the handler's guards, its router's included: the cheapest check, and the one that names the route."""
    assert require_admin in handler.resolve_guards(), f"{method} {path} is neither allow-listed nor admin-guarded"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> Iterator[Gateway]:
    """One gateway for every route (nothing here may change its state), with tenant `acme`."""
    tmp = tmp_path_factory.mktemp("guards")
    state = StubState()
    stub = ServerThread(stub_app(state)).start()
    (tmp / "tiers.yaml").write_text(tiers_yaml(stub.url, f"http://127.0.0.1:{free_port()}"))
    (tmp / "plans.yaml").write_text(PLANS_YAML)
    settings = Settings(data_dir=tmp / "data", models_dir=prepared_models, tiers_file=tmp / "tiers.yaml",
                        plans_file=tmp / "plans.yaml", max_body_bytes=64 * 1024)
    try:
        with running_gateway(settings, state) as gw:
            gw.store.create_tenant(HIDDEN, "standard")  # a name no document or page could hold by chance
            yield gw
    finally:
        stub.stop()


@pytest.fixture(scope="module")
def dead_admin_keys(gateway: Gateway) -> dict[str, str]:
    """Admin keys that were valid: one revoked, one whose expiry has passed (set in the store, as time would)."""
    _, revoked = gateway.store.issue_key(None, name="revoked", roles=(ADMIN,))
    gateway.store.revoke_key(revoked.split("-")[1])
    expiring, expired = gateway.store.issue_key(None, name="expired", roles=(ADMIN,), ttl_s=3600)
    gateway.store._execute("UPDATE api_keys SET expires_at = ? WHERE key_id = ?", (time.time() - 1, expiring.key_id))
    gateway.store._invalidate()
    return {"revoked": revoked, "expired": expired}


def _path(template: str, gateway: Gateway) -> str:
    values = PATH_VALUES | {"key_id": gateway.tenant_key.split("-")[1]}
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: values.get(m.group(1), "acme"), template)


READINGS = ("metrics", "metrics_judged_at", "own_window_metrics")  # the ladder's, read at each tick: no one's change


def _state(gateway: Gateway) -> dict[str, Any]:
    """What an admin route could change or reveal: tenants, keys, data versions, the ladder (but its readings, which
    its ticks renew), rollouts."""
    with gateway.client(gateway.admin_key) as admin:
        state = {path: admin.get(path).json() for path in (
            "/admin/tenants", "/admin/keys", "/admin/degrade", "/admin/degrade/history", "/admin/rollouts",
            "/admin/rollouts/history")} | {"data_version": gateway.store.data_version("acme")}
    for reading in READINGS:
        state["/admin/degrade"].pop(reading, None)
    return state


def _refusals(gateway: Gateway, dead: dict[str, str]) -> list[tuple[str, dict[str, str], int]]:
    """(what, headers, status) for every caller that must not pass an admin route."""
    admin, tenant = gateway.admin_key, gateway.tenant_key
    return [
        ("no key", {}, 401),
        ("an empty Authorization", {"authorization": ""}, 401),
        ("a scheme with no key", {"authorization": "Bearer"}, 401),
        ("the admin key under Basic", {"authorization": f"Basic {admin}"}, 401),
        ("the admin key under Token", {"authorization": f"Token {admin}"}, 401),
        ("the admin key without the space", {"authorization": f"Bearer{admin}"}, 401),
        ("the admin key with a word after it", {"authorization": f"Bearer {admin} {admin}"}, 401),
        ("the admin key cut short", {"authorization": f"Bearer {admin[:-1]}"}, 401),
        ("a key not shaped like ours", {"authorization": "Bearer sk-" + "x" * 64}, 401),
        ("a revoked admin key", {"authorization": f"Bearer {dead['revoked']}"}, 401),
        ("an expired admin key", {"authorization": f"Bearer {dead['expired']}"}, 401),
        ("a tenant's key", {"authorization": f"Bearer {tenant}"}, 403),
        ("a tenant's key, lower-case scheme", {"authorization": f"bearer {tenant}"}, 403),
        ("a tenant's key as X-API-Key", {"x-api-key": tenant}, 403),
        # two keys in the two headers: refused as conflicting before either is looked up (gateway/auth.py)
        ("a tenant's bearer key beside the admin key as X-API-Key", {"authorization": f"Bearer {tenant}",
                                                                     "x-api-key": admin}, 400),
    ]


@pytest.mark.parametrize(("method", "template"), ADMIN_ROUTES, ids=[f"{m} {p}" for m, p in ADMIN_ROUTES])
def test_every_admin_route_refuses_every_caller_but_an_admin(gateway: Gateway, dead_admin_keys: dict[str, str],
                                                             method: str, template: str) -> None:
    path = _path(template, gateway)
    body = BODIES.get(template.rstrip("/"), {}) if method not in ("GET", "OPTIONS") else None
    before = _state(gateway)
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for what, headers, status in _refusals(gateway, dead_admin_keys):
            r = c.request(method, path, headers=headers, json=body)
            assert r.status_code == status, (what, r.status_code, r.text)
            error = r.json()["error"]
            assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, (what, r.text)
            assert error["type"] == ERROR_TYPES[status], (what, r.text)
            # nothing of the state or of the keys it was sent: no tenant, no key id, no secret
            words = set(re.findall(r"[\w.-]+", r.text))
            assert not {"acme", HIDDEN, "mid", gateway.tenant_key.split("-")[1]} & words, what
            assert gateway.admin_key not in r.text and gateway.tenant_key not in r.text, what
    assert _state(gateway) == before  # nothing was changed


@pytest.mark.parametrize(("method", "template"), ADMIN_ROUTES, ids=[f"{m} {p}" for m, p in ADMIN_ROUTES])
def test_an_admin_key_passes_in_any_case_of_its_scheme_and_an_unknown_query_is_refused(
        gateway: Gateway, method: str, template: str) -> None:
    """The key is accepted (the answer is the route's own 400 for the query, not a 401), and the query parameter
    no route takes is refused by name before anything runs: nothing changes, for GET and POST alike."""
    path = _path(template, gateway)
    body = BODIES.get(template.rstrip("/"), {}) if method not in ("GET", "OPTIONS") else None
    before = _state(gateway)
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for scheme in ("bearer", "BEARER", "bEaReR"):
            r = c.request(method, path, params={"zz_unknown": "1"}, json=body,
                          headers={"authorization": f"{scheme} {gateway.admin_key}"})
            assert r.status_code == 400, (scheme, r.status_code, r.text[:300])
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("zz_unknown", "unsupported_parameter")
        if method == "OPTIONS":  # and without the unknown parameter, the admin key gets Litestar's own answer
            r = c.options(path, headers={"authorization": f"Bearer {gateway.admin_key}"})
            assert r.status_code == 204 and {"GET", "POST"} & set(r.headers["allow"].split(", ")), r.text
    assert _state(gateway) == before


@pytest.mark.parametrize(("method", "template"), sorted(PUBLIC))
def test_a_public_route_reveals_no_tenant_key_or_tier_state(gateway: Gateway, method: str, template: str) -> None:
    """What a stranger reads names no tenant or key of this deployment, nor where its tiers or data are, and is the
    same with a tenant's key."""
    path = template.replace("{path:str}", "nothing-here")
    with gateway.client(None) as anonymous, gateway.client(gateway.tenant_key) as tenant:
        r = anonymous.request(method, path)
        assert r.status_code in (200, 404, 503), r.text[:300]
        assert tenant.request(method, path).content == r.content
    words = set(re.findall(r"[\w.-]+", r.text))
    assert not {HIDDEN, gateway.tenant_key.split("-")[1], gateway.admin_key.split("-")[1]} & words, path
    upstream = gateway.app.state.services.catalogue.tiers["mid"].urls[0]
    assert upstream not in r.text and str(gateway.settings.data_dir) not in r.text, path


@pytest.mark.parametrize(("method", "template"), sorted(TENANT))
def test_every_tenant_route_refuses_a_missing_or_dead_key(gateway: Gateway, dead_admin_keys: dict[str, str],
                                                          method: str, template: str) -> None:
    path = _path(template, gateway).replace("acme", "mid")
    body = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for headers in ({}, {"authorization": "Bearer"}, {"authorization": f"Bearer {dead_admin_keys['revoked']}"}):
            r = c.request(method, path, headers=headers, json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
    assert gateway.ledger_rows() == []


def test_a_tenant_cannot_ask_for_another_tenants_usage(gateway: Gateway) -> None:
    """`tenant` is the admin report's parameter; on a tenant's report it is refused, never ignored or obeyed."""
    with gateway.client(gateway.tenant_key) as c:
        for query in ({"tenant": "other"}, {"tenant": "acme"}, {"by": "tenant", "tenant": "other"}):
            r = c.get("/v1/usage", params=query)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tenant", r.text
