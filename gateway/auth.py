"""Who is asking: the bearer key → a principal. Provided to handlers as dependencies."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler

from gateway.errors import Forbidden, Unauthenticated
from gateway.tenants.store import Principal, TenantStore


def presented_key(request: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


async def authenticate_async(request: ASGIConnection[Any, Any, Any, Any], store: TenantStore) -> Principal:
    """The principal for the request's key, or a 401. A key id not cached is looked up off the event loop (anyone
    can send a made-up one, and with the fleet database each is a network round trip); a 503 when too many are
    being looked up."""
    return _checked(request, await store.authenticate_async(_required_key(request)))


def _required_key(request: ASGIConnection[Any, Any, Any, Any]) -> str:
    key = presented_key(request)
    if key is None:
        raise Unauthenticated("no API key: send `Authorization: Bearer tg-…`", code="missing_api_key")
    return key


def _checked(request: ASGIConnection[Any, Any, Any, Any], principal: Principal | None) -> Principal:
    if principal is None:
        raise Unauthenticated("the API key is unknown, revoked or expired")
    request.state.key_id = principal.key.key_id
    return principal


async def provide_principal(request: Request[Any, Any, Any], store: NamedDependency[TenantStore]) -> Principal:
    """Any valid key: a tenant's or an admin's."""
    return await authenticate_async(request, store)


async def provide_tenant(request: Request[Any, Any, Any], store: NamedDependency[TenantStore]) -> Principal:
    """A tenant's key; admin keys manage the gateway but do not call models."""
    return await tenant_principal_async(request, store)


async def tenant_principal_async(request: ASGIConnection[Any, Any, Any, Any], store: TenantStore) -> Principal:
    """`provide_tenant` without Litestar's dependency resolution, for the model routes' hot path (resolving a
    dependency and its own cost a chat request ~4% of its time)."""
    return _tenant_only(await authenticate_async(request, store))


def _tenant_only(principal: Principal) -> Principal:
    if principal.tenant is None:
        raise Forbidden("admin keys cannot call models; use a tenant key", code="tenant_key_required")
    return principal


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard for admin routes (async, so it runs on the event loop that owns the store). Guards get no
    dependencies in Litestar, so this one reads the store from the app's state."""
    if not (await authenticate_async(connection, connection.app.state.services.store)).key.is_admin:
        raise Forbidden("this route needs an admin key", code="admin_key_required")
