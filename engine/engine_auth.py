"""Who may call an engine: the key a remote engine requires, and the refusal to serve the network without one.

The gateway's supervisor starts each local engine on 127.0.0.1, where only this host reaches it. An engine served
beyond the host (`tiergate engine serve --host 0.0.0.0`, a remote tier of another machine's gateway) answered anyone
who reached its port: free inference, and any caller could send another tenant's cache salt (the header the gateway
sets) and time the prefix cache and the grammar memo as that tenant. So:

- with a key in the environment (`TIERGATE_ENGINE_API_KEY`, or the variable `--api-key-env` names: never on the
  command line, where `ps` shows it), every route but /health needs `Authorization: Bearer <key>`, compared in
  constant time (`hmac.compare_digest` of the two SHA-256 digests, so not even the key's length shows), and a missing
  or wrong one is a 401 `invalid_api_key` in OpenAI's shape, before the body is read. The gateway sends it from the
  tier's `api_key_env`, as to any remote OpenAI-compatible server. A path or method no route serves is a 404 or 405
  first (Litestar routes before this check): that shows only the public list of routes. /health stays open, as a load
  balancer or supervisor probes it, with its status only: its `stats` (load, and the KV share of everyone but the
  largest tenant, from which the largest one's follows) go to callers with the key;
- the key must be visible ASCII (what an HTTP header carries as sent): another was a key no caller could send, the
  gateway's client included, so `check_exposure` refuses it at start, naming the variable;
- without one, `check_exposure` refuses a host other than a loopback address, unless the operator says
  `--allow-unauthenticated` (a private network that does its own access control).

The key is never logged; a refusal says what was wrong, not what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any

from litestar import Request, Response

from wire.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class ExposureError(ValueError):
    """An engine would serve beyond this host with no key, or with a key no caller can send."""


def is_loopback(host: str) -> bool:
    """`host` (as uvicorn binds it) reaches only this machine: localhost, 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def check_exposure(host: str, api_key: str | None, *, allow_unauthenticated: bool, key_env: str) -> None:
    if api_key and not all("!" <= c <= "~" for c in api_key):
        raise ExposureError(f"{key_env} holds characters an HTTP header cannot carry as sent (only visible ASCII, "
                            f"without spaces): no caller could send that key")
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise ExposureError(f"--host {host} serves beyond this machine and {key_env} is not set: anyone who reaches the "
                        f"port could use the engine and claim any tenant's cache salt. Set {key_env} (the gateway "
                        f"sends it from the tier's api_key_env), or pass --allow-unauthenticated where the network "
                        f"controls access")


class KeyCheck:
    """Whether a request carries the engine's key, and the Litestar `before_request` hook that refuses one without."""

    def __init__(self, api_key: str) -> None:
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def holds(self, request: Request[Any, Any, Any]) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")  # the scheme's case is free
        sent = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(sent, self._digest) and scheme.lower() == "bearer"

    async def guard(self, request: Request[Any, Any, Any]) -> Response[Any] | None:
        if request.url.path in OPEN_PATHS or self.holds(request):
            return None
        reason = "the API key is not this engine's" if request.headers.get("authorization") else "no API key was sent"
        return Response(error_body(f"{reason}: send `Authorization: Bearer <key>`", code="invalid_api_key"),
                        status_code=401, headers={"www-authenticate": "Bearer"})


def key_check(api_key: str | None) -> KeyCheck | None:
    """The check of `api_key` (None: no key, an open engine)."""
    return KeyCheck(api_key) if api_key else None
