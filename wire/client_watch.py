"""A client's disconnect, heard while its answer is being made, shared by the gateway's routes and the engine's.

A non-streamed answer is made before its first byte is sent, so nothing tells the server its client has gone:
the gateway's routes would settle a request as answered (and bill it) that no one read, and the engine went on
generating for no one (six non-streamed requests of 1,200 tokens whose clients left after 0.5 s were all still
running 15 s later, holding 90% of the KV cache, where a streamed one is aborted at once). `ClientWatch` listens
for the ASGI `http.disconnect` for the whole request, one listener task, and cancels the work it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection; nobody reads it


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


class ClientWatch:
    """Listens for the client's disconnect for the whole request (one listener task, not one per wait): while
    `run` awaits work, a disconnect cancels the handler's task, and `run` turns that into ClientLeft."""

    def __init__(self, request: Any) -> None:
        self._handler = asyncio.current_task()
        self._left = self._running = False
        self._listener = asyncio.ensure_future(_disconnected(request))
        self._listener.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, listener: asyncio.Future[None]) -> None:
        if listener.cancelled():
            return
        self._left = True
        if self._running and self._handler is not None:
            self._handler.cancel()

    async def run(self, work: Awaitable[T]) -> T:
        """`work`'s result, or ClientLeft (with `work` cancelled) as soon as the client disconnects."""
        if self._left:
            if (close := getattr(work, "close", None)) is not None:
                close()  # never to be awaited: closed, so Python does not warn of it
            raise ClientLeft
        self._running = True
        try:
            return await work
        except asyncio.CancelledError:
            if not self._left or self._handler is None:
                raise
            self._handler.uncancel()  # our own cancel, answered: the task is not being cancelled any more
            raise ClientLeft from None
        finally:
            self._running = False

    def close(self) -> None:
        self._listener.cancel()


async def _disconnected(request: Any) -> None:
    """Returns when the client has gone (the body is read already, so the next message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
