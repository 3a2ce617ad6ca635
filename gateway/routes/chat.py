"""POST /v1/chat/completions: OpenAI's chat API, streaming and not. The handler hands the request to the
pipeline (gateway/pipeline/handle.py) and frames its events: server-sent events, or one JSON completion.

A client that leaves stops its work: until the answer's first byte is sent (for a stream) or until the
whole answer is ready (otherwise), the handler also listens for the client's disconnect and then cancels
the pipeline, which settles the request as cancelled and billed for what ran.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from litestar import Request, Response, post
from litestar.di import NamedDependency, Provide
from litestar.openapi import ResponseSpec
from litestar.response import Stream
from pydantic import ConfigDict

from gateway.auth import provide_tenant
from gateway.errors import TiergateError
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Delta, Done, Event, Head
from gateway.routes.openapi import BEARER, MODEL_ERRORS, also, body, errors
from gateway.services import Services
from gateway.tenants.store import Principal
from wire import responses
from wire.chat_request import ChatCompletionRequest, request_schema
from wire.response_models import ChatCompletion

T = TypeVar("T")


def _without_priority(schema: dict[str, Any]) -> None:
    request_schema(schema)
    schema["properties"].pop("priority", None)
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection; nobody reads it


class ChatRequestBody(ChatCompletionRequest):
    """The chat request as this gateway documents it: OpenAI's, without vLLM's `priority`, which our engines take
    but the gateway refuses (a tenant's plan sets its priority)."""

    model_config = ConfigDict(title="ChatCompletionRequest", json_schema_extra=_without_priority)


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


@post("/v1/chat/completions", status_code=200, tags=["OpenAI"], summary="Create a chat completion",
      dependencies={"principal": Provide(provide_tenant), "openapi_body": body(ChatRequestBody)},
      security=BEARER, operation_class=also("text/event-stream"),
      responses={200: ResponseSpec(ChatCompletion, generate_examples=False,
                                   description="The completion; with `stream: true`, server-sent events of "
                                               "`chat.completion.chunk` objects ending with `data: [DONE]`"),
                 **errors(*MODEL_ERRORS)})
async def chat_completions(request: Request[Any, Any, Any], principal: NamedDependency[Principal]) -> Response[Any]:
    """OpenAI's chat completions, routed to a tier by the tenant's plan (`model`: a tier, or `auto`)."""
    # the pipeline and the plans from the app's services, not as dependencies: Litestar resolves two or more
    # dependencies of one level in an anyio task group, a task each, which cost every request ~6% of its time
    services: Services = request.app.state.services
    ctx = RequestContext(request.state.request_id, principal,
                         services.plans.plans[principal.tenant.plan],  # type: ignore[union-attr]
                         {k.lower(): v for k, v in request.headers.items()}, time.time(), request.state.t0)
    events = services.pipeline.handle(ctx, await request.body())
    watch = _ClientWatch(request)
    try:
        head = await watch.run(anext(events))
        request.state.tier = head.model
        if head.stream:
            return Stream(_sse(head, events), media_type="text/event-stream",
                          headers={**head.headers, "cache-control": "no-cache"})
        return Response(await watch.run(_completion(head, events)), headers=dict(head.headers))
    except ClientLeft:
        await events.aclose()
        return Response(None, status_code=CLIENT_CLOSED)
    finally:
        watch.close()


async def _completion(head: Head, events: AsyncIterator[Event]) -> dict[str, Any]:
    text: list[str] = []
    logprobs: list[dict[str, Any]] | None = None
    done = Done(None, 0, 0)
    async for event in events:
        if isinstance(event, Delta):
            text.append(event.content)
            if event.logprobs is not None:
                logprobs = (logprobs or []) + event.logprobs
        elif isinstance(event, Done):
            done = event
    return responses.completion(id_=head.response_id, created=head.created, model=head.model, text="".join(text),
                                finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens,
                                completion_tokens=done.completion_tokens, logprobs=logprobs)


async def _sse(head: Head, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The answer as OpenAI streams it; an error after the first byte is a last `data: {"error": …}` event."""
    ids = {"id_": head.response_id, "created": head.created, "model": head.model}
    usage_null = {"usage": None} if head.include_usage else {}  # as OpenAI: null on every chunk but the last
    try:
        yield responses.sse(responses.chunk(**ids, delta={"role": "assistant", "content": ""}, **usage_null))
        async for event in events:
            if isinstance(event, Delta):
                yield responses.sse(responses.chunk(**ids, delta={"content": event.content}, logprobs=event.logprobs,
                                                    **usage_null))
            elif isinstance(event, Done):
                yield responses.sse(responses.chunk(**ids, delta={}, finish_reason=event.finish_reason, **usage_null))
                if head.include_usage:
                    yield responses.sse(responses.usage_chunk(**ids, prompt_tokens=event.prompt_tokens,
                                                              completion_tokens=event.completion_tokens))
    except TiergateError as err:
        yield responses.sse(err.body())
        return
    finally:
        await events.aclose()  # a client that left mid-stream: the pipeline settles it as cancelled
    yield responses.SSE_DONE


class _ClientWatch:
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
