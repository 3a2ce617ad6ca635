"""An ASGI app whose answers are held half-sent until a test releases them: a connection being answered, for as long
as a test needs, on a real uvicorn server with the gateway's protocol (tests.stubs.ServerThread)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


def held_answer(release: threading.Event) -> Any:
    """An app that answers any request "first" at once and "-rest" once `release` is set (10 bytes, by length)."""
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"-rest"})

    return app
