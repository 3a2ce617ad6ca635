"""What the model routes share: the pipeline's events for one request, answered as JSON or as a stream.

The chat and text-completion routes differ only in how they read the body and how they frame the events
(`Framing`). A client that leaves stops its work: until the answer's first byte is sent (for a stream) or until
the whole answer is ready (otherwise), the handler also listens for the client's disconnect and then cancels the
pipeline, which settles the request as cancelled and billed for what ran.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from litestar import Request, Response
from litestar.response import Stream

from gateway.auth import tenant_principal_async
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Event, Head
from gateway.services import Services
from wire.chat_request import ChatCompletionRequest

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection; nobody reads it


@dataclass(frozen=True)
class Framing:
    parse: Callable[[bytes], ChatCompletionRequest]  # the body, as the pipeline carries it
    whole: Callable[[Head, AsyncIterator[Event]], Awaitable[dict[str, Any]]]  # the JSON answer
    stream: Callable[[Head, AsyncIterator[Event]], AsyncIterator[bytes]]  # server-sent events


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


async def answer(request: Request[Any, Any, Any], framing: Framing) -> Response[Any]:
    """Authenticate the tenant's key, run the pipeline on the request's body and answer as `framing` says."""
    # the key, the pipeline and the plans from the app's services, not as dependencies: Litestar resolves two or
    # more dependencies of one level in an anyio task group, a task each, which cost every request ~6% of its time,
    # and one dependency with its own ~4% (the route's `security` documents the key in the OpenAPI schema)
    services: Services = request.app.state.services
    principal = await tenant_principal_async(request, services.store)  # a key id not cached: off the loop
    ctx = RequestContext(request.state.request_id, principal,
                         services.plans.plans[principal.tenant.plan],  # type: ignore[union-attr]
                         {k.lower(): v for k, v in request.headers.items()}, time.time(), request.state.t0)
    events = services.pipeline.handle(ctx, await request.body(), framing.parse)
    watch = ClientWatch(request)
    try:
        head = await watch.run(anext(events))
        request.state.tier = head.model
        if head.stream:
            return Stream(framing.stream(head, events), media_type="text/event-stream",
                          headers={**head.headers, "cache-control": "no-cache"})
        return Response(await watch.run(framing.whole(head, events)), headers=dict(head.headers))
    except ClientLeft:
        await events.aclose()
        return Response(None, status_code=CLIENT_CLOSED)
    finally:
        watch.close()


class ClientWatch:
    """Listens for the client's disconnect for the whole request (one listener task, not one per wait): while
    `run` awaits work, a disconnect cancels the handler's task, and `run` turns that into ClientLeft."""

    def __init__(self, request: Request[Any, Any, Any]) -> None:
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


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the client has gone (the body is read already, so the next message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
