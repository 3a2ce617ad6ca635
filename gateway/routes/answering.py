"""What the model routes share: the pipeline's events for one request, answered as JSON or as a stream.

The chat and text-completion routes differ only in how they read the body and how they frame the events
(`Framing`). A client that leaves stops its work: until the answer's first byte is sent (for a stream) or until
the whole answer is ready (otherwise), the handler also listens for the client's disconnect and then cancels the
pipeline, which settles the request as cancelled and billed for what ran. A key revoked (or expiring) while its answer
is produced ends it the same way (gateway/auth.py, `while_key_active`), with a 401 `api_key_revoked`. The request's
place in its tenant's concurrency is held until its JSON answer (or error) is handed over to the client, or the
client is gone (gateway/middleware.py `hold_until_sent`), not only until the answer is made; a stream's, until its
work ends. Its concurrency slot in the quota store (shared by the replicas on Redis) is freed with that place, not at
its settle (gateway/pipeline/reserve.py `_keep_slot`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.response import Stream
from litestar.serialization import get_serializer
from litestar.types import ASGIApp, Receive, ReceiveMessage, Scope, Send

from gateway.auth import presented_key, tenant_principal_async, while_key_active
from gateway.errors import InternalError, TiergateError, stream_client_error
from gateway.middleware import hold_until_sent
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Event, Head
from gateway.query_params import refuse_query
from gateway.request_headers import request_headers
from gateway.services import Services
from gateway.tenant_plans import tenant_plan
from wire import responses
from wire.chat_request import ChatCompletionRequest
from wire.client_watch import CLIENT_CLOSED, ClientLeft, ClientWatch

log = logging.getLogger("tiergate.answering")


@dataclass(frozen=True)
class Framing:
    parse: Callable[[bytes], ChatCompletionRequest]  # the body, as the pipeline carries it
    whole: Callable[[Head, AsyncIterator[Event]], Awaitable[dict[str, Any]]]  # the JSON answer
    stream: Callable[[Head, AsyncIterator[Event]], AsyncIterator[bytes]]  # server-sent events


async def answer(request: Request[Any, Any, Any], framing: Framing) -> Response[Any]:
    """Authenticate the tenant's key, run the pipeline on the request's body and answer as `framing` says."""
    # the key, the pipeline and the plans from the app's services, not as dependencies: Litestar resolves two or
    # more dependencies of one level in an anyio task group, a task each, which cost every request ~6% of its time,
    # and one dependency with its own ~4% (the route's `security` documents the key in the OpenAPI schema)
    services: Services = request.app.state.services
    principal = await tenant_principal_async(request, services.store)  # a key id not cached: off the loop
    refuse_query(request)  # the body says everything; a query would be dropped
    # the request's state as the middleware wrote it (gateway/middleware.py): `request.state` builds a new State
    # (with its own lock) at every read, ~2 us each
    state = request.scope["state"]
    ctx = RequestContext(state["request_id"], principal, tenant_plan(services.plans, principal),
                         request_headers(request), time.time(), state["t0"])
    # the tenant's gate before its body is read: past its concurrency, a connection is refused with its body unread
    # (gateway/pipeline/gate.py `Pass`); the pipeline leaves the place once it starts, this route until then
    entry = services.pipeline.admit(ctx)
    hold_until_sent(request.scope, entry)  # and keeps it until its answer's body is handed over, not only made
    try:
        events = while_key_active(services.pipeline.handle(ctx, await request.body(), framing.parse, entry),
                                  services.store, presented_key(request) or "")  # a key revoked mid-answer ends it
        watch = ClientWatch(request)
        try:
            head = await watch.run(anext(events))
            state["tier"] = head.model
            if head.stream:  # its place is its pipeline's, as ever: held while each frame waits on the client (one
                # at a time, small), given back once its work ends (or is stopped: a lost Idempotency-Key lease)
                entry.let_go()
                return StreamedAnswer(framing.stream(head, events), events, media_type="text/event-stream",
                                      headers={**head.headers, "cache-control": "no-cache"})
            return WholeAnswer(await watch.run(framing.whole(head, events)), headers=dict(head.headers))
        except ClientLeft:
            await events.aclose()
            return Response(None, status_code=CLIENT_CLOSED)
        finally:
            watch.close()
    finally:
        if not entry.taken:  # the pipeline never started (the body cut short, the client gone first)
            entry.leave()


def stream_error(head: Head, exc: Exception) -> bytes:
    """The last event of a stream that failed after its first byte: `exc` in OpenAI's shape, as a JSON answer's error
    would be (gateway/app.py maps those). Not only our own errors: the answer's ledger row not durable in time (the
    settle's `LedgerUnavailable`, raised once every token is sent) broke the connection mid-body, the client told
    nothing of it but a protocol error, uvicorn logging an ASGI exception. That row stays queued and commits, billed:
    the event says so (`UsageRecordedLate`: do not retry), not the JSON answer's 503 "retry later"."""
    err = stream_client_error(exc)
    if isinstance(err, InternalError) and not isinstance(exc, TiergateError):
        log.error("unexpected error in the stream of %s", head.response_id, exc_info=exc)
    return responses.sse(err.body())


class StreamedAnswer(Stream):
    """A streamed answer whose events are closed when its response ends, however it ends: the pipeline's `finally`
    (the settle, the gate's place, the upstream's connection) runs then, not when the garbage collector frees the
    generators. Litestar's streaming response cancels its sending task when the client disconnects and leaves the
    iterator as it was; a client that left while a chunk waited to be sent (a slow reader, the server's flow control
    holding the send) left it suspended at a `yield`, in a reference cycle through the cancellation's traceback, and
    until a collection its request held the tenant's concurrency slot (a tenant allowed one request at a time was
    refused 429), the tier's dispatch slot and its reservation, the upstream went on generating, and no row was
    written (tests/gateway/test_stream_slow_client_leaves.py).

    No event is taken from the pipeline once the client's disconnect has been received (`_while_connected`).
    uvicorn drops what is sent to a connection that has gone, without an error, and Litestar's own ending, a
    cancellation of the sending task, reaches it only when the task waits on something not yet done: while the tier's
    bytes kept coming, each wait on them was done by the time the cancellation was tried, and the answer went on being
    read from the tier, metered (and billed) and dropped. A client cut off for not reading (gateway/http_limits.py)
    had 3.9 MB written to its connection and 9-15 MB more read from the tier after its cut, in 0.2-0.4 s; with 20 such
    clients at once, 112 MB after the first 11 cuts, over 6 s (tests/gateway/test_http_limits.py)."""

    __slots__ = ("events", "frames", "gone")

    def __init__(self, content: AsyncIterator[bytes], events: AsyncGenerator[Event, None], **kwargs: Any) -> None:
        self.gone = False  # the client's disconnect has been received
        self.frames = content
        super().__init__(self._while_connected(), **kwargs)
        self.events = events  # what `content` frames: closed too, in case `content` never started

    async def _while_connected(self) -> AsyncGenerator[bytes, None]:
        """The frames, until the client has gone: checked as each is asked for, after the last one was sent."""
        async for frame in self.frames:
            yield frame
            if self.gone:
                return

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIApp:
        respond = super().to_asgi_response(*args, **kwargs)
        relay, frames, events = self.iterator, self.frames, self.events

        async def respond_then_close(scope: Scope, receive: Receive, send: Send) -> None:
            async def receive_noting_gone() -> ReceiveMessage:  # what Litestar's listener for the disconnect reads
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.gone = True
                return message

            try:
                await respond(scope, receive_noting_gone, send)
            finally:
                try:
                    await relay.aclose()  # type: ignore[union-attr]
                finally:
                    try:
                        await frames.aclose()  # type: ignore[attr-defined]  # an async generator (the framing's)
                    finally:
                        await events.aclose()
        return respond_then_close


JSON = "application/json"
_OWN_HEADERS = frozenset({"content-type", "content-length"})  # headers Litestar sets only where the answer has none


class WholeAnswer(Response[Any]):
    """A whole JSON answer, sent as Litestar would send it (the same bytes and headers: `content-type`,
    `content-length`, the answer's own), without building Litestar's ASGIResponse: its case-insensitive header
    structure (a `setdefault` through `MutableMapping`'s mixin, a `KeyError` caught per header) and its encoding
    cost ~6% of an exact cache hit's CPU (bench/gateway_profile.py, path b). Anything else the route or app adds
    (its own headers, cookies, a background task, a HEAD request) takes Litestar's own way."""

    def to_asgi_response(self, app: Any, request: Request[Any, Any, Any], *, background: Any = None,
                         cookies: Any = None, encoded_headers: Any = None, headers: dict[str, str] | None = None,
                         is_head_response: bool = False, media_type: Any = None, status_code: int | None = None,
                         type_encoders: Any = None) -> ASGIApp:
        if background or self.background or cookies or self.cookies or encoded_headers or headers \
                or is_head_response or self.media_type \
                or (media_type or JSON) != JSON or not _OWN_HEADERS.isdisjoint(map(str.lower, self.headers)):
            return super().to_asgi_response(app, request, background=background, cookies=cookies,
                                            encoded_headers=encoded_headers, headers=headers,
                                            is_head_response=is_head_response, media_type=media_type,
                                            status_code=status_code, type_encoders=type_encoders)
        encoders = {**type_encoders, **self.response_type_encoders} if type_encoders else self.response_type_encoders
        body = self.render(self.content, JSON, get_serializer(encoders))
        raw = [*((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()),
               (b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
        status = self.status_code or status_code or 200

        async def send_answer(scope: Scope, receive: Receive, send: Send) -> None:
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        return send_answer
