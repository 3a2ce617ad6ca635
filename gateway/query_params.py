"""Query parameters a route does not take, and a parameter sent twice, are refused by name, never ignored.

Litestar ignores a query parameter no handler parameter names, and on an admin route that answered something else than
asked: `GET /admin/keys?tenat=acme` (a typo) listed every tenant's keys, and `POST /admin/keys/{id}/rotate?grace_s=3600`
revoked the old key at once (the grace period is a body field), both with a 200. A route says what it takes in its
`opt` (`opt={"query": ("tenant",)}`; none when absent), and `only_declared_query` guards it.

Every query parameter of ours takes one value, and of one sent twice Litestar used one silently:
`GET /admin/usage/report?tenant=a&tenant=b` reported on one of the two tenants with a 200.

The OpenAI routes (chat and text completions, embeddings, models) take none (`refuse_query`): what a client put in
the query was dropped and the request answered as if it had not asked (`?stream=true` answered whole, `?user=u` kept
no end user apart, `?api-version=...` answered as some version).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from gateway.errors import InvalidRequest

QUERY_OPT = "query"  # the route handler's `opt` entry naming the query parameters it takes


def refuse_unknown(names: Iterable[str], known: tuple[str, ...]) -> None:
    """An InvalidRequest naming the first of `names` (every parameter of the query, in order, each as often as it was
    sent) that is not `known`, or that was sent before, if any."""
    seen: set[str] = set()
    for name in names:
        if name not in known:
            takes = f"this route takes {', '.join(known)}" if known else "this route takes none"
            raise InvalidRequest(f"{name[:64]}: unsupported query parameter ({takes}); remove it", param=name[:64],
                                 code="unsupported_parameter")
        if name in seen:
            raise InvalidRequest(f"{name}: sent more than once; it takes one value", param=name,
                                 code="duplicate_parameter")
        seen.add(name)


async def only_declared_query(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard: a 400 for a query parameter the route does not declare in its `opt` (after the admin guard, so that a
    key that may not use the route learns nothing of what it takes)."""
    refuse_unknown(query_names(connection), tuple(handler.opt.get(QUERY_OPT, ())))


def refuse_query(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """A 400 naming the first query parameter of a request to a route that takes none (a look at the raw query
    string: nothing is parsed for a request without one)."""
    if connection.scope["query_string"]:
        refuse_unknown(query_names(connection), ())


def query_names(connection: ASGIConnection[Any, Any, Any, Any]) -> list[str]:
    """The names of the query's parameters, in order, each as often as it was sent (read from the query string as
    Litestar reads it: its `query_params` group the names in an order that changes from one process to the next, so
    which of two unknown names a refusal named did too)."""
    query = connection.scope.get("query_string", b"").decode("latin-1")
    return [name for name, _ in parse_qsl(query, keep_blank_values=True)]
