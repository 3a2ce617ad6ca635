"""POST /v1/chat/completions: OpenAI's chat API, streaming and not. The handler hands the request to the
pipeline (gateway/pipeline/handle.py, through gateway/routes/answering.py) and frames its events as OpenAI's chat
objects: server-sent `chat.completion.chunk` events, or one `chat.completion`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from pydantic import ConfigDict

from gateway.pipeline.events import Delta, Done, Event, Head
from gateway.pipeline.handle import parse_request
from gateway.pipeline.tool_call_pieces import ToolCallPieces
from gateway.routes.answering import Framing, answer, stream_error
from gateway.routes.openapi import BEARER, MODEL_ERRORS, also, body, errors
from gateway.validation import ServedStreamOptions
from wire import responses
from wire.chat_request import ChatCompletionRequest, request_schema
from wire.response_models import ChatCompletion


def _without_priority(schema: dict[str, Any]) -> None:
    request_schema(schema)
    schema["properties"].pop("priority", None)


class ChatRequestBody(ChatCompletionRequest):
    """The chat request as this gateway documents it: OpenAI's, without vLLM's `priority` and with
    `stream_options.continuous_usage_stats` only false, which our engines take but the gateway refuses
    (gateway/validation.refuse_engine_only: a tenant's plan sets its priority)."""

    model_config = ConfigDict(title="ChatCompletionRequest", json_schema_extra=_without_priority)

    stream_options: ServedStreamOptions | None = None


@post("/v1/chat/completions", status_code=200, tags=["OpenAI"], summary="Create a chat completion",
      dependencies={"openapi_body": body(ChatRequestBody)},
      security=BEARER, operation_class=also("text/event-stream"),
      responses={200: ResponseSpec(ChatCompletion, generate_examples=False,
                                   description="The completion; with `stream: true`, server-sent events of "
                                               "`chat.completion.chunk` objects ending with `data: [DONE]`"),
                 **errors(*MODEL_ERRORS)})
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """OpenAI's chat completions, routed to a tier by the tenant's plan (`model`: a tier, or `auto`)."""
    return await answer(request, CHAT)


async def _whole(head: Head, events: AsyncIterator[Event]) -> dict[str, Any]:
    """The answer as one `chat.completion`, built at its `Done`, before its attempt settles: a body that fails to
    build is told to the pipeline (`Done.not_sent`), which settles the attempt as that error, billed nothing."""
    text: list[str] = []
    logprobs: list[dict[str, Any]] | None = None
    calls = ToolCallPieces()
    body: dict[str, Any] | None = None
    failed: Exception | None = None  # what kept the body from being built
    async for event in events:
        if isinstance(event, Delta):
            text.append(event.content)
            if event.logprobs is not None:  # extended in place: joining lists anew was quadratic in the answer
                logprobs = logprobs if logprobs is not None else []
                logprobs.extend(event.logprobs)
            for entry in event.tool_calls or ():
                calls.add(entry)
        elif isinstance(event, Done):
            try:
                body = _completion(head, text, logprobs, calls, event)
            except Exception as exc:  # read on: the pipeline settles the attempt, and raises its error
                failed = event.not_sent(exc)
    if failed is not None:
        raise failed
    return body if body is not None else _completion(head, text, logprobs, calls, Done(None, 0, 0))


def _completion(head: Head, text: list[str], logprobs: list[dict[str, Any]] | None, calls: ToolCallPieces,
                done: Done) -> dict[str, Any]:
    content = "".join(text)
    return responses.completion(id_=head.response_id, created=head.created, model=head.model,
                                text=content if content or not calls else None, finish_reason=done.finish_reason,
                                prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                                logprobs=logprobs, tool_calls=calls.calls() or None)


async def _sse(head: Head, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The answer as OpenAI streams it; an error after the first byte is a last `data: {"error": …}` event."""
    ids = {"id_": head.response_id, "created": head.created, "model": head.model}
    usage_null = {"usage": None} if head.include_usage else {}  # as OpenAI: null on every chunk but the last
    try:
        yield responses.sse(responses.chunk(**ids, delta={"role": "assistant", "content": ""}, **usage_null))
        async for event in events:
            if isinstance(event, Delta):
                delta: dict[str, Any] = {"content": event.content} if event.content or not event.tool_calls else {}
                if event.tool_calls:
                    delta["tool_calls"] = event.tool_calls
                yield responses.sse(responses.chunk(**ids, delta=delta, logprobs=event.logprobs, **usage_null))
            elif isinstance(event, Done):
                yield responses.sse(responses.chunk(**ids, delta={}, finish_reason=event.finish_reason, **usage_null))
                if head.include_usage:
                    yield responses.sse(responses.usage_chunk(**ids, prompt_tokens=event.prompt_tokens,
                                                              completion_tokens=event.completion_tokens))
    except Exception as exc:  # every failure after the first byte is the stream's last event
        yield stream_error(head, exc)
        return
    finally:
        await events.aclose()  # a client that left mid-stream: the pipeline settles it as cancelled
    yield responses.SSE_DONE


CHAT = Framing(parse_request, _whole, _sse)
