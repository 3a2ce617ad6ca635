"""GET /health (no key: for load balancers) and GET /metrics (admin key: it names tenants)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from gateway.auth import require_admin


@get("/health")
async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """200 when every tier that can run is ready; 503 with the reasons while any is starting or down.

    A tier whose model is not built yet (or is being built) is reported but does not hold readiness back: the gateway
    routes around it.
    """
    fleet = request.app.state.services.fleet
    tiers = fleet.status()
    waiting = {name: s for name, s in tiers.items()
               if not s["ready"] and any(r["status"] not in ("unavailable", "preparing") for r in s["replicas"])}
    ready = not waiting
    body = {"status": "ok" if ready else "starting", "tiers": tiers,
            "not_ready": {name: fleet.unavailable().get(name) for name in tiers if not tiers[name]["ready"]}}
    return Response(body, status_code=200 if ready else 503)


@get("/metrics", guards=[require_admin])
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(request.app.state.services.metrics.render(), media_type="text/plain; version=0.0.4")
