"""Who is asking: the bearer key → a principal. Provided to handlers as dependencies.

A key's end ends what it has open: `while_key_active` looks at the key again at most every KEY_RECHECK_S while an
answer is produced, so a key an admin revokes (or that expires) stops its streams at their next event after that,
not at the end of their `max_tokens`. The look is the request path's own (a cached key costs no query), and a
revocation reaches it as it reaches new requests (gateway/tenants/store.py: at once on the replica that revoked,
within 20 ms on another process of the host, within 0.5 s on another replica of the fleet).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler

from gateway.errors import Forbidden, InvalidRequest, Unauthenticated, Unavailable
from gateway.tenants.records import Principal
from gateway.tenants.store import TenantStore

KEY_RECHECK_S = 1.0  # an open answer looks at its key again at most this often
T = TypeVar("T")


def presented_key(request: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The Authorization header's bearer key, else X-API-Key's; None when there is none, or when an Authorization
    header carries none (another scheme, no key): it is never passed over for X-API-Key (`_required_key`)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if header.strip():
        return None
    return request.headers.get("x-api-key") or None


async def authenticate_async(request: ASGIConnection[Any, Any, Any, Any], store: TenantStore) -> Principal:
    """The principal for the request's key, or a 401. A key id not cached is looked up off the event loop (anyone
    can send a made-up one, and with the fleet database each is a network round trip); a 503 when too many are
    being looked up."""
    return _checked(request, await store.authenticate_async(_required_key(request)))


def _required_key(request: ASGIConnection[Any, Any, Any, Any]) -> str:
    _sent_once(request)
    key = presented_key(request)
    if key is None and request.headers.get("authorization", "").strip():
        # `Authorization: Basic …` beside a valid X-API-Key was that key's request, the header dropped: refused as
        # it is alone. Its value is never echoed (a key sent without its scheme would be the whole of it).
        raise Unauthenticated("the Authorization header carries no key: its scheme must be Bearer "
                              "(`Authorization: Bearer tg-…`), or leave it out and send the key in X-API-Key",
                              param="authorization", code="missing_api_key")
    if key is None:
        raise Unauthenticated("no API key: send `Authorization: Bearer tg-…`", code="missing_api_key")
    other = request.headers.get("x-api-key")
    if other is not None and other != key and request.headers.get("authorization") is not None:
        # two keys, one in each header: the Authorization one was read and the other ignored, so a caller was
        # whoever a proxy in front did not take it for, as with a header sent twice (`_sent_once`)
        raise InvalidRequest("the Authorization and X-API-Key headers carry different keys; send one key, in one "
                             "of them", param="x-api-key", code="conflicting_api_keys")
    return key


def _sent_once(request: ASGIConnection[Any, Any, Any, Any]) -> None:
    """A 400 `duplicate_header` when the key's header (Authorization, X-API-Key) was sent more than once. The first
    was read and the rest ignored, so `Authorization: Bearer <valid>` then `Authorization: Bearer <other>` was the
    valid key's request on every route but the model routes (which refuse a repeated one after the key's check):
    what a proxy in front that reads the last line took for one caller, the gateway took for another."""
    names = [name for name, _ in request.scope["headers"] if name in _KEY_HEADERS]
    if len(names) > 1 and len(set(names)) < len(names):
        name = max(set(names), key=names.count).decode()
        raise InvalidRequest(f"the {name} header was sent {names.count(name.encode())} times; it takes one value: "
                             "send it once", param=name, code="duplicate_header")


_KEY_HEADERS = (b"authorization", b"x-api-key")  # as uvicorn hands them over: lower case


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
    _no_idempotency_key(connection)


def _no_idempotency_key(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """A 400 naming Idempotency-Key on an admin route that changes something: none keeps a key's answer, so a retry
    of `POST /admin/keys` after a lost answer issued a second live key (and a second rotation), the first one a
    credential nobody saw. Refused, as embeddings refuse it where no store keeps answers, never dropped."""
    if connection.scope.get("method") not in _SAFE_METHODS and _IDEMPOTENCY_KEY in connection.headers:
        raise InvalidRequest("Idempotency-Key is not supported on admin routes: an admin change is not replayed, "
                             "so a retry runs it again; list what exists (GET) before retrying a lost answer",
                             param="Idempotency-Key", code="unsupported_parameter")


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")  # they change nothing: a retry is harmless, the header moot
_IDEMPOTENCY_KEY = "idempotency-key"  # gateway/pipeline/idempotency.py's HEADER


async def while_key_active(events: AsyncGenerator[T, None], store: TenantStore,
                           presented: str) -> AsyncGenerator[T, None]:
    """`events` until the key that asked is revoked or expires; then they are closed (the pipeline settles the request
    as cancelled, billed for what ran, as when a client leaves) and a 401 `api_key_revoked` is raised, which a stream
    sends as its last event. A look that cannot be made now (too many key ids being looked up) lets the answer go on."""
    checked = time.monotonic()
    try:
        async for event in events:
            if time.monotonic() - checked >= KEY_RECHECK_S:
                checked = time.monotonic()
                try:
                    active = await store.authenticate_async(presented) is not None
                except Unavailable:
                    active = True
                if not active:
                    raise Unauthenticated("the API key was revoked or expired while this answer was produced",
                                          code="api_key_revoked")
            yield event
    finally:
        await events.aclose()
