"""POST /v1/chat/completions: OpenAI's chat API, streaming and not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.di import NamedDependency, Provide
from litestar.response import Stream

from engine.protocol import ChatCompletionRequest
from gateway.auth import provide_tenant
from gateway.chat_service import Call, ChatService, sse
from gateway.errors import TiergateError, map_tier_error
from gateway.tenants.store import Principal
from gateway.validation import parse_body
from tiers.errors import TierError


@post("/v1/chat/completions", dependencies={"principal": Provide(provide_tenant)}, status_code=200)
async def chat_completions(request: Request[Any, Any, Any], principal: NamedDependency[Principal]) -> Response[Any]:
    req = parse_body(await request.body(), ChatCompletionRequest)
    services = request.app.state.services
    call = Call(request.state.request_id, principal, req, arrived=time.time(), t0=request.state.t0,
                headers={k.lower(): v for k, v in request.headers.items()})
    await services.chat.admit(call)
    request.state.tier = call.tier.name
    return await respond(services.chat, call)


async def respond(chat: ChatService, call: Call) -> Response[Any]:
    if call.is_cache_hit:
        return await respond_from_cache(chat, call)
    if not call.req.stream:
        call, text = await chat.answer(call)
        return Response(chat.completion(call, text), headers=_headers(call))
    stream, first = await chat.start(call)
    return Stream(_sse_body(chat, call, stream, first), media_type="text/event-stream",
                  headers=_headers(call) | {"cache-control": "no-cache"})


def _headers(call: Call) -> dict[str, str]:
    headers = {"x-tiergate-tier": call.tier.name, "x-tiergate-route-reason": call.route.reason,  # type: ignore[union-attr]
               **call.admitted.headers}  # type: ignore[union-attr]
    if call.degradation is not None and call.degradation.applied:
        headers["x-tiergate-degrade-actions"] = ",".join(call.degradation.applied)
    if call.cascade is not None:
        headers["x-tiergate-cascade"] = call.cascade
    return headers


async def respond_from_cache(chat: ChatService, call: Call) -> Response[Any]:
    """A cached answer: the same shapes a fresh one has, JSON or SSE, settled (durably) before it ends."""
    hit = call.cache_result
    usage = hit.usage
    call.input_tokens = int(usage.get("prompt_tokens", 0))
    call.output_tokens = int(usage.get("completion_tokens", 0))
    call.finish_reason = usage.get("finish_reason") or "stop"
    call.ttft_s = time.perf_counter() - call.t0
    headers = _headers(call)
    if not call.req.stream:
        await chat.settle(call, "ok", 200)
        return Response(chat.completion(call, hit.response), headers=headers)
    return Stream(_cached_sse(chat, call, hit.response), media_type="text/event-stream",
                  headers=headers | {"cache-control": "no-cache"})


async def _cached_sse(chat: ChatService, call: Call, text: str) -> AsyncIterator[bytes]:
    base = {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion.chunk", "created": int(call.arrived),
            "model": call.tier.name}
    for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": text}, None),
                          ({}, call.finish_reason)):
        chunk = base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if call.req.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        yield sse(chunk)
    await chat.settle(call, "ok", 200)
    if call.req.include_usage:
        yield sse(base | {"choices": [], "usage": {
            "prompt_tokens": call.input_tokens, "completion_tokens": call.output_tokens,
            "total_tokens": call.input_tokens + call.output_tokens}})
    yield sse("[DONE]")


async def _sse_body(chat: ChatService, call: Call, stream: AsyncIterator[dict[str, Any]],
                    first: dict[str, Any] | None) -> AsyncIterator[bytes]:
    """Relay upstream chunks; the ledger row is durable before the client reads `[DONE]`."""
    usage_chunk: dict[str, Any] | None = None
    try:
        chunk = first
        while chunk is not None:
            out = chat.client_chunk(call, chunk)
            if out is not None:
                if out.get("choices"):
                    yield sse(out)
                else:
                    usage_chunk = out  # held until the row is written
            chunk = await anext(stream, None)
    except TierError as exc:
        err: TiergateError = map_tier_error(exc)
        await chat.settle(call, "error", err.status_code, error_code=err.code)
        yield sse(err.body())
        return
    except (asyncio.CancelledError, GeneratorExit):
        await stream.aclose()
        await chat.settle(call, "cancelled", 499, wait=False)
        raise
    await chat.settle(call, "ok", 200)
    if usage_chunk is not None:
        yield sse(usage_chunk)
    yield sse("[DONE]")
