"""GET /health (no key: for load balancers) and GET /metrics (admin key: it names tenants)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from gateway.auth import presented_key, require_admin


@get("/health")
async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """200 {"status": "ok"} when every tier that can run is ready; 503 {"status": "starting"} while any is starting
    or down.

    Anyone may ask whether the gateway is ready; only an admin key sees why not (tiers, replicas, reasons, model
    versions), which would otherwise tell a stranger what runs here and what is failing. A missing, wrong or tenant
    key gets the short answer, never a 401, so a load balancer's probe needs no key.

    A tier whose model is not built yet (or is being built) is reported but does not hold readiness back: the gateway
    routes around it.
    """
    services = request.app.state.services
    tiers = services.fleet.status()
    waiting = {name: s for name, s in tiers.items()
               if not s["ready"] and any(r["status"] not in ("unavailable", "preparing") for r in s["replicas"])}
    ready = not waiting
    body: dict[str, Any] = {"status": "ok" if ready else "starting"}
    key = presented_key(request)
    principal = services.store.authenticate(key) if key else None
    if principal is not None and principal.key.is_admin:
        body |= {"tiers": tiers,
                 "not_ready": {name: services.fleet.unavailable().get(name) for name in tiers
                               if not tiers[name]["ready"]}}
    return Response(body, status_code=200 if ready else 503)


@get("/metrics", guards=[require_admin])
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(request.app.state.services.metrics.render(), media_type="text/plain; version=0.0.4")
