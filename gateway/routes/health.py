"""GET /health (no key: for load balancers) and GET /metrics (admin key: it names tenants; it takes no query, and a
parameter sent is refused by name, as on every admin route, not ignored).

/metrics is rendered on a thread of its own, one render at a time: scrapes that come while one renders get its text
(gateway/one_flight.py). It rendered on the event loop: 3,000 tenants, 1.2-2 s blocked a scrape (12.4 MB), and
every request waited that long; two Prometheus servers, or a retried scrape, doubled it. The collectors run on that
thread: prometheus-client's metrics read under their own locks, and ours (gateway/metrics.py and the others
registered) read what is set at start (the tiers, the queues), replaced whole (an engine's stats), copied in one
step (the rollouts, the cache's counts) or read under its lock (the cache's bounds).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from litestar.openapi import ResponseSpec

from gateway.auth import presented_key
from gateway.errors import Unavailable
from gateway.metrics import GatewayMetrics
from gateway.one_flight import OneFlight
from gateway.redis_eviction_watch import RedisEvictionWatch
from gateway.routes.guarded import admin_only
from gateway.routes.openapi import BEARER, errors
from gateway.tenants.store import TenantStore
from quotas.ledger import Ledger
from tiers.fleet import Fleet

_RENDERS = OneFlight("tiergate-metrics")


@get("/health", tags=["operations"], security=[{}, *BEARER], responses={
    503: ResponseSpec(dict[str, Any], generate_examples=False,
                      description='Not ready: `{"status": "starting"}` (and, for an admin key, why)'),
    **errors(500)})
async def health(request: Request[Any, Any, Any], fleet: NamedDependency[Fleet],
                 store: NamedDependency[TenantStore], ledger: NamedDependency[Ledger],
                 redis_eviction: NamedDependency[RedisEvictionWatch | None]) -> Response[dict[str, Any]]:
    """200 {"status": "ok"} when every tier that can run is ready; 503 {"status": "starting"} while any is starting
    or down.

    Anyone may ask whether the gateway is ready; only an admin key sees why not (tiers, replicas, reasons, model
    versions), which would otherwise tell a stranger what runs here and what is failing. A missing, wrong or tenant
    key gets the short answer, never a 401, so a load balancer's probe needs no key.

    A tier whose model is not built yet (or is being built) is reported but does not hold readiness back: the gateway
    routes around it. A Redis that may now evict keys does, unless allowed (gateway/redis_eviction_watch.py).
    """
    ready, details = readiness(fleet, ledger, redis_eviction)
    body: dict[str, Any] = {"status": "ok" if ready else "starting"}
    key = presented_key(request)
    try:  # a made-up key id is looked up off the event loop, as on the model routes
        principal = await store.authenticate_async(key) if key else None
    except Unavailable:  # too many key ids being looked up at once: the short answer
        principal = None
    if principal is not None and principal.key.is_admin:
        body |= details
    return Response(body, status_code=200 if ready else 503)


def readiness(fleet: Fleet, ledger: Ledger,
              redis_eviction: RedisEvictionWatch | None = None) -> tuple[bool, dict[str, Any]]:
    """Whether the gateway can take work (every tier that can run is ready, the ledger can write, and its Redis may
    not evict keys unless allowed), and the details: each tier's status, why a tier is not ready, why the ledger is
    not (null when it is), and what was last read of Redis's eviction policy (with TIERGATE_REDIS_URL)."""
    tiers = fleet.status()
    waiting = {name: s for name, s in tiers.items()
               if not s["ready"] and any(r["status"] not in ("unavailable", "preparing") for r in s["replicas"])}
    unavailable = fleet.unavailable(detail=True)  # shown to an admin key only
    ledger_reason = ledger.not_ready_reason
    redis_reason = None if redis_eviction is None else redis_eviction.not_ready_reason
    details: dict[str, Any] = {
        "tiers": tiers, "not_ready": {name: unavailable.get(name) for name in tiers if not tiers[name]["ready"]},
        "ledger": ledger_reason}
    if redis_eviction is not None:
        details["redis"] = redis_eviction.details() | {"not_ready": redis_reason}
    return not waiting and ledger_reason is None and redis_reason is None, details


@get("/metrics", tags=["operations"], security=BEARER,
     media_type="text/plain", responses=errors(400, 401, 403, 500))
async def metrics(metrics: NamedDependency[GatewayMetrics]) -> Response[bytes]:
    return Response(await _RENDERS.run(metrics, metrics.render), media_type="text/plain; version=0.0.4")


metrics_router = admin_only(metrics)
