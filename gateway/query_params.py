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

An integer parameter (`limit`) takes an integer's digits only, as JSON writes one (`-?(0|[1-9][0-9]*)`): msgspec,
which Litestar reads it with, takes a float's text whose value is whole, so `?limit=1e3` answered a thousand events
and `?limit=1.0` one, with a 200. Anything else is refused by name (400 `invalid_value`), before the route parses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache
from typing import Any
from urllib.parse import parse_qsl

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import ParameterKwarg

from gateway.errors import InvalidRequest

QUERY_OPT = "query"  # the route handler's `opt` entry naming the query parameters it takes
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")  # JSON's integer: ASCII digits, a minus at most, no leading zero


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
    query = query_pairs(connection)
    refuse_unknown([name for name, _ in query], tuple(handler.opt.get(QUERY_OPT, ())))
    if query:
        refuse_non_integers(query, integer_names(handler))


def refuse_non_integers(query: list[tuple[str, str]], integers: frozenset[str]) -> None:
    """An InvalidRequest naming the first parameter of `integers` whose value in `query` is not an integer's digits
    (`1e3`, `1.0`, `+5`, ` 5`, `0x10`, `1_000`, `٥` and the like: what msgspec or int() reads as a number and a
    client would not mean as this one). The route's own bounds (`ge`, `le`) still apply after."""
    for name, value in query:
        if name in integers and _INTEGER.fullmatch(value) is None:
            shown = repr(value) if len(value) <= 40 else f"{value[:40]!r}..."
            raise InvalidRequest(f"{name}: {shown} is not an integer; give its digits, as {name}=100", param=name,
                                 code="invalid_value")


@cache  # a route's signature does not change: read once per route, not per request
def integer_names(handler: BaseRouteHandler) -> frozenset[str]:
    """The query parameters `handler` reads as integers (`int` or `int | None`), by the name the query sends."""
    names = set()
    for field_name, field in handler.parsed_fn_signature.parameters.items():
        if field.is_subclass_of(int) or (field.is_optional and field.has_inner_subclass_of(int)):
            kwarg = field.kwarg_definition
            names.add(kwarg.name or field_name if isinstance(kwarg, ParameterKwarg) else field_name)
    return frozenset(names)


def refuse_query(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """A 400 naming the first query parameter of a request to a route that takes none (a look at the raw query
    string: nothing is parsed for a request without one)."""
    if connection.scope["query_string"]:
        refuse_unknown(query_names(connection), ())


def query_names(connection: ASGIConnection[Any, Any, Any, Any]) -> list[str]:
    """The names of the query's parameters, in order, each as often as it was sent (`query_pairs`)."""
    return [name for name, _ in query_pairs(connection)]


def query_pairs(connection: ASGIConnection[Any, Any, Any, Any]) -> list[tuple[str, str]]:
    """The query's parameters and their values, in order, each name as often as it was sent (read from the query
    string as Litestar reads it: its `query_params` group the names in an order that changes from one process to the
    next, so which of two unknown names a refusal named did too)."""
    query = connection.scope.get("query_string", b"").decode("latin-1")
    return parse_qsl(query, keep_blank_values=True)
