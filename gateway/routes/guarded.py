"""Admin handlers registered on their own: the admin guards go on a router around them, not on the handlers."""

from __future__ import annotations

from litestar import Router
from litestar.handlers import HTTPRouteHandler

from gateway.auth import require_admin
from gateway.query_params import only_declared_query


def admin_only(*handlers: HTTPRouteHandler) -> Router:
    """`handlers` (each with its full path) behind the admin key and the declared-query check, every method of their
    paths included. Litestar answers OPTIONS on a path with a handler of its own that takes the guards of the route's
    owner: with the guards on the handlers and the app as owner, OPTIONS /metrics, /admin/ops and /admin/usage/report
    answered 204 without a key while every other method there needed the admin key."""
    return Router("/", guards=[require_admin, only_declared_query], route_handlers=list(handlers))
