"""Stamps every response with `x-tiergate-request-id` and `x-tiergate-tier` (`none` before routing)."""

from __future__ import annotations

import itertools
import os
import secrets
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send


class _RequestIds:
    """32 hex digits unique across processes and replicas without a syscall per request (uuid4 reads the
    kernel's random source every time): 16 random digits per process, then a counter."""

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()

    def next(self) -> str:
        if self._pid != os.getpid():  # a forked worker gets its own prefix
            self._pid, self._prefix, self._counter = os.getpid(), secrets.token_hex(8), itertools.count()
        return f"{self._prefix}{next(self._counter):016x}"


_ids = _RequestIds()


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})  # type: ignore[typeddict-item]
        state["request_id"] = _ids.next()
        state["t0"] = time.perf_counter()

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                headers.append((b"x-tiergate-request-id", state["request_id"].encode()))
                if b"x-tiergate-tier" not in names:
                    headers.append((b"x-tiergate-tier", str(state.get("tier") or "none").encode()))
                ladder = getattr(getattr(scope["app"].state, "services", None), "ladder", None)  # type: ignore[index]
                if ladder is not None:
                    headers.append((b"x-tiergate-degrade-level", str(ladder.level).encode()))
                message["headers"] = headers
            await send(message)

        await app(scope, receive, send_with_ids)

    return middleware
