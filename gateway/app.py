"""The Litestar app factory: nothing is loaded at import time; `create_app` wires the services."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException, ValidationException

from cache import RedisStore, SemanticCache, SQLiteStore, default_embedder
from gateway.admission import AdmissionService
from gateway.cache_service import CacheService
from gateway.chat_service import ChatService
from gateway.config_files import load_yaml
from gateway.errors import TiergateError
from gateway.ladder.config import Ladder
from gateway.ladder.controller import LadderController
from gateway.ladder.signals import Signals
from gateway.ladder.state import open_store
from gateway.metrics import GatewayMetrics
from gateway.middleware import request_id_middleware
from gateway.routes.admin import admin_router
from gateway.routes.chat import chat_completions
from gateway.routes.dashboard import dashboard
from gateway.routes.degrade import degrade_router
from gateway.routes.health import health, metrics
from gateway.routes.models import list_models
from gateway.routes.ops import ops
from gateway.routes.usage import admin_report, tenant_report
from gateway.services import Services
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.admission import QuotaService
from quotas.backends.base import QuotaBackend
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.dispatch import TierQueue
from quotas.ledger import Ledger
from quotas.plans import PlanBook
from quotas.seed import seed_from_ledger
from tiers.catalogue import TierCatalogue, TierSpec
from tiers.client import TierClient
from tiers.fleet import Fleet
from tiers.predictor import PredictorSource

log = logging.getLogger("tiergate.gateway")
_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def load_config(settings: Settings) -> tuple[TierCatalogue, PlanBook]:
    """Parse and cross-check the tiers, plans and ladder files; raises ConfigFileError with file and line."""
    catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    plans = load_yaml(settings.plans_file, PlanBook, context={"tiers": set(catalogue.tiers)})
    load_yaml(settings.ladder_file, Ladder)
    return catalogue, plans


def build_services(settings: Settings) -> Services:
    catalogue, plans = load_config(settings)
    client = TierClient(connect_timeout_s=settings.upstream_connect_timeout_s,
                        read_timeout_s=settings.upstream_read_timeout_s)
    fleet = Fleet(catalogue, client, models_dir=settings.resolved_models_dir,
                  log_dir=settings.data_dir / "logs", start_timeout_s=settings.engine_start_timeout_s)
    metrics_ = GatewayMetrics(fleet)
    ledger = Ledger(settings.ledger_db)
    store = TenantStore(settings.state_db)
    backend = build_quota_backend(settings, ledger, metrics_)
    queues = {name: TierQueue(name, tier_capacity(spec, settings), policy=settings.dispatch_policy)
              for name, spec in catalogue.tiers.items()}
    metrics_.queues = queues
    signals = Signals(tiers_down=fleet.num_tiers_down, kv_utilisation=fleet.max_kv_utilisation,
                      redis_down=lambda: isinstance(backend, FailoverBackend) and not backend.up)
    ladder = LadderController(load_yaml(settings.ladder_file, Ladder),
                              open_store(settings.data_dir, settings.redis_url), signals,
                              on_change=metrics_.degrade_changed)
    metrics_.ladder = ladder
    cache = CacheService(build_cache(settings), store, fleet)
    admission = AdmissionService(fleet=fleet, plans=plans, quotas=QuotaService(backend), queues=queues,
                                 metrics=metrics_, models_dir=str(settings.resolved_models_dir),
                                 default_max_tokens=settings.default_max_tokens, ladder=ladder, cache=cache,
                                 predictor=PredictorSource.for_data_dir(settings.data_dir))
    chat = ChatService(fleet=fleet, client=client, ledger=ledger, metrics=metrics_, admission=admission,
                       queues=queues, signals=signals, cache=cache)
    return Services(settings, catalogue, plans, store, ledger, client, fleet, metrics_, chat, backend, ladder, cache)


def build_cache(settings: Settings) -> SemanticCache | None:
    """Entries in Redis (every replica's index follows) when TIERGATE_REDIS_URL is set, else in SQLite."""
    if not settings.cache_enabled:
        return None
    if settings.redis_url:
        entries = RedisStore(settings.redis_url, max_entries=settings.cache_max_entries)
    else:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        entries = SQLiteStore(settings.data_dir / "cache.sqlite3", max_entries=settings.cache_max_entries)
    return SemanticCache(entries, default_embedder())


def build_quota_backend(settings: Settings, ledger: Ledger, metrics_: GatewayMetrics) -> QuotaBackend:
    """Redis (shared, with the configured failure mode) when TIERGATE_REDIS_URL is set; else memory, seeded
    from the ledger so budgets and windows survive a restart."""
    if settings.redis_url:
        redis = RedisBackend(settings.redis_url, timeout_s=settings.redis_timeout_s)
        return FailoverBackend(redis, mode=settings.redis_failure_mode, on_state=metrics_.redis_state)
    memory = MemoryBackend()
    seed_from_ledger(memory, ledger)
    return memory


def tier_capacity(spec: TierSpec, settings: Settings) -> int:
    """Dispatch slots: per replica, the tier's max_concurrency, else what its engines batch at once."""
    if spec.backend == "local":
        return spec.replicas * (spec.max_concurrency or spec.max_num_seqs)
    return len(spec.urls) * (spec.max_concurrency or settings.remote_max_concurrency)


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or Settings()
    catalogue, plans = load_config(settings)  # fail fast, before anything starts
    del catalogue, plans

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        services = build_services(settings)
        app.state.services = services
        services.ledger.start()
        await services.fleet.start()
        if services.cache.cache is not None:  # load the embedder before the first request needs it
            await asyncio.to_thread(services.cache.cache.embedder.encode_one, "warm up")
        ticker = asyncio.create_task(_tick_ladder(services.ladder, settings.ladder_tick_s))
        try:
            yield
        finally:
            ticker.cancel()
            await services.fleet.stop()
            await services.client.aclose()
            await services.quota_backend.close()
            await services.cache.drain()
            if services.cache.cache is not None:
                services.cache.cache.close()
            services.ledger.close()
            services.store.close()

    return Litestar(
        route_handlers=[chat_completions, list_models, health, metrics, admin_router, degrade_router, admin_report,
                        tenant_report, ops, dashboard],
        lifespan=[lifespan],
        middleware=[request_id_middleware],
        exception_handlers={TiergateError: _tiergate_error, HTTPException: _http_error,
                            Exception: _unexpected_error},
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
    )


async def _tick_ladder(ladder: LadderController, every_s: float) -> None:
    """Follow shared changes and evaluate triggers; a failing store is logged, never fatal."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(ladder.tick)
        except Exception:  # the ladder keeps its last level; the next tick tries again
            log.exception("degradation ladder tick failed")


def _tiergate_error(request: Request[Any, Any, Any], exc: TiergateError) -> Response[Any]:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(1, round(exc.retry_after)))
    return Response(exc.body(), status_code=exc.status_code, headers=headers)


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    message = str(exc.detail)
    if isinstance(exc, ValidationException) and exc.extra:
        message = f"{message}: {exc.extra}"
    if status == 413:
        message = f"the request body is larger than this gateway accepts ({request.app.request_max_body_size} bytes)"
    body = {"error": {"message": message, "type": _HTTP_TYPES.get(status, "api_error"), "param": None,
                      "code": {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(status)}}
    return Response(body, status_code=status, headers=dict(exc.headers or {}))


def _unexpected_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    rid = request.scope.get("state", {}).get("request_id")
    log.exception("unexpected error in request %s", rid)
    body = {"error": {"message": f"internal error (request id {rid}); it has been logged", "type": "api_error",
                      "param": None, "code": "internal_error"}}
    return Response(body, status_code=500)
