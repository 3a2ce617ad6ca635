"""No route may be read from another origin's page: the gateway answers no CORS preflight with a grant and sends no
`Access-Control-Allow-*` header, so a browser keeps a page elsewhere from reading the admin API (or the model API)
even with a key the browser holds. The dashboard is served from the gateway's own origin and needs none."""

from __future__ import annotations

from tests.conftest import Gateway
from tests.gateway.test_admin_routes_guarded import admin_routes

EVIL = "https://evil.example"


def test_no_route_grants_another_origin(gateway: Gateway) -> None:
    paths = {path for _, path in admin_routes(gateway)} | {"/v1/chat/completions", "/v1/models", "/dashboard"}
    with gateway.client(gateway.admin_key) as admin:
        for path in sorted(paths):
            preflight = admin.options(path, headers={"origin": EVIL, "access-control-request-method": "POST",
                                                     "access-control-request-headers": "authorization"})
            actual = admin.get(path, headers={"origin": EVIL})
            for r in (preflight, actual):
                granted = {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}
                assert not granted, (r.request.method, path, granted)
