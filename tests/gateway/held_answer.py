"""Bare ASGI apps for tests on a real uvicorn server with the gateway's protocol (tests.stubs.ServerThread): `served`,
the lifespan they all answer alike, and `held_answer`, whose answers are held half-sent until a test releases them (a
connection being answered, for as long as a test needs)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

Answer = Callable[[Any, Any], Awaitable[None]]  # given a request's receive and send, answers it


def served(answer: Answer) -> Any:
    """An ASGI app that starts and stops at once and has `answer(receive, send)` answer each request."""
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await answer(receive, send)

    return app


def held_answer(release: threading.Event) -> Any:
    """An app that answers any request "first" at once and "-rest" once `release` is set (10 bytes, by length)."""
    async def answer(receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"-rest"})

    return served(answer)
