"""The Litestar app factory: nothing is loaded at import time; `create_app` wires the services."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException, ValidationException

from gateway.chat_service import ChatService
from gateway.config_files import load_yaml
from gateway.errors import TiergateError
from gateway.metrics import GatewayMetrics
from gateway.middleware import request_id_middleware
from gateway.routes.admin import admin_router
from gateway.routes.chat import chat_completions
from gateway.routes.health import health, metrics
from gateway.routes.models import list_models
from gateway.services import Services
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.ledger import Ledger
from quotas.plans import PlanBook
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

log = logging.getLogger("tiergate.gateway")
_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def load_config(settings: Settings) -> tuple[TierCatalogue, PlanBook]:
    """Parse and cross-check the tiers and plans files; raises ConfigFileError with file and line."""
    catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    plans = load_yaml(settings.plans_file, PlanBook, context={"tiers": set(catalogue.tiers)})
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
    chat = ChatService(fleet=fleet, client=client, ledger=ledger, metrics=metrics_, plans=plans)
    return Services(settings, catalogue, plans, store, ledger, client, fleet, metrics_, chat)


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
        try:
            yield
        finally:
            await services.fleet.stop()
            await services.client.aclose()
            services.ledger.close()
            services.store.close()

    return Litestar(
        route_handlers=[chat_completions, list_models, health, metrics, admin_router],
        lifespan=[lifespan],
        middleware=[request_id_middleware],
        exception_handlers={TiergateError: _tiergate_error, HTTPException: _http_error,
                            Exception: _unexpected_error},
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
    )


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
