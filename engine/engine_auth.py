"""Who may call an engine: the key a remote engine requires, and the refusal to serve the network without one.

The gateway's supervisor starts each local engine on 127.0.0.1, where only this host reaches it. An engine served
beyond the host (`tiergate engine serve --host 0.0.0.0`, a remote tier of another machine's gateway) answered anyone
who reached its port: free inference, and any caller could send another tenant's cache salt (the header the gateway
sets) and time the prefix cache and the grammar memo as that tenant. So:

- with a key in the environment (`TIERGATE_ENGINE_API_KEY`, or the variable `--api-key-env` names: never on the
  command line, where `ps` shows it), every route but /health needs `Authorization: Bearer <key>`, compared in
  constant time (`hmac.compare_digest` on the bytes), and a missing or wrong one is a 401 `invalid_api_key` in
  OpenAI's shape, before the body is read. The gateway sends it from the tier's `api_key_env`, as to any remote
  OpenAI-compatible server. /health stays open: it is what a load balancer or supervisor probes, and says nothing of
  any tenant;
- without one, `check_exposure` refuses a host other than a loopback address, unless the operator says
  `--allow-unauthenticated` (a private network that does its own access control).

The key is never logged; a refusal says what was wrong, not what was sent.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Request, Response

from wire.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class ExposureError(ValueError):
    """An engine would serve beyond this host with no key."""


def is_loopback(host: str) -> bool:
    """`host` (as uvicorn binds it) reaches only this machine: localhost, 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def check_exposure(host: str, api_key: str | None, *, allow_unauthenticated: bool, key_env: str) -> None:
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise ExposureError(f"--host {host} serves beyond this machine and {key_env} is not set: anyone who reaches the "
                        f"port could use the engine and claim any tenant's cache salt. Set {key_env} (the gateway "
                        f"sends it from the tier's api_key_env), or pass --allow-unauthenticated where the network "
                        f"controls access")


def key_guard(api_key: str | None) -> Callable[[Request[Any, Any, Any]], Awaitable[Response[Any] | None]] | None:
    """A Litestar `before_request` hook that refuses a request without `api_key` (None: no key, no hook)."""
    if not api_key:
        return None
    expected = api_key.encode()

    async def guard(request: Request[Any, Any, Any]) -> Response[Any] | None:
        if request.url.path in OPEN_PATHS:
            return None
        sent = request.headers.get("authorization", "")
        scheme, _, token = sent.partition(" ")  # the scheme's case is free (RFC 9110), the key's is not
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode("utf-8", "surrogateescape"), expected):
            return None
        reason = "no API key was sent" if not sent else "the API key is not this engine's"
        return Response(error_body(f"{reason}: send `Authorization: Bearer <key>`", code="invalid_api_key"),
                        status_code=401, headers={"www-authenticate": "Bearer"})

    return guard
