"""POST /v1/completions: OpenAI's legacy text completions, streaming and not, on every tier.

The prompt goes to the tier as it was sent, with no chat template (gateway/pipeline/text_completion.py); every
other stage is the chat route's: the plan's tiers and limits, the cache (which never mixes the two), the ledger.
The events are framed as OpenAI frames a text completion: one `text_completion` object, or a stream of them whose
choices carry the next piece of `text`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from pydantic import ConfigDict

from gateway.pipeline.events import Delta, Done, Event, Head
from gateway.pipeline.text_completion import parse_completion
from gateway.routes.answering import Framing, answer, stream_error
from gateway.routes.openapi import BEARER, MODEL_ERRORS, also, body, errors
from gateway.validation import ServedStreamOptions
from wire import responses
from wire.completion_request import CompletionRequest, completion_schema
from wire.response_models import TextCompletion


def _served_fields(schema: dict[str, Any]) -> None:
    completion_schema(schema)
    for name in ("priority", "logprobs"):  # our engines take them; through the gateway they are refused
        schema["properties"].pop(name, None)


class CompletionRequestBody(CompletionRequest):
    """The text-completion request as this gateway documents it: without `priority` (a plan sets it) and the
    legacy `logprobs` (not served through the gateway), which are refused by name, and with
    `stream_options.continuous_usage_stats` only false (true is refused by name too)."""

    model_config = ConfigDict(title="CompletionRequest", json_schema_extra=_served_fields)

    stream_options: ServedStreamOptions | None = None


@post("/v1/completions", status_code=200, tags=["OpenAI"], summary="Create a text completion (legacy)",
      dependencies={"openapi_body": body(CompletionRequestBody)},
      security=BEARER, operation_class=also("text/event-stream"),
      responses={200: ResponseSpec(TextCompletion, generate_examples=False,
                                   description="The completion; with `stream: true`, server-sent events of "
                                               "`text_completion` objects ending with `data: [DONE]`"),
                 **errors(*MODEL_ERRORS)})
async def text_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """OpenAI's legacy completions: the prompt continued as it is, routed like a chat request."""
    return await answer(request, TEXT)


def _id(head: Head) -> str:
    """OpenAI's `cmpl-` ids for text completions (the same request id as the pipeline's, so a replay matches)."""
    return "cmpl-" + head.response_id.removeprefix("chatcmpl-")


async def _whole(head: Head, events: AsyncIterator[Event]) -> dict[str, Any]:
    """The answer as one `text_completion`, built at its `Done`, before its attempt settles, as chat's is."""
    text: list[str] = []
    body: dict[str, Any] | None = None
    failed: Exception | None = None  # what kept the body from being built
    async for event in events:
        if isinstance(event, Delta):
            text.append(event.content)
        elif isinstance(event, Done):
            try:
                body = _completion(head, text, event)
            except Exception as exc:  # read on: the pipeline settles the attempt, and raises its error
                failed = event.not_sent(exc)
    if failed is not None:
        raise failed
    return body if body is not None else _completion(head, text, Done(None, 0, 0))


def _completion(head: Head, text: list[str], done: Done) -> dict[str, Any]:
    return responses.text_completion(id_=_id(head), created=head.created, model=head.model, text="".join(text),
                                     finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens,
                                     completion_tokens=done.completion_tokens)


async def _sse(head: Head, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The answer as OpenAI streams text completions; an error after the first byte is a last error event."""
    ids = {"id_": _id(head), "created": head.created, "model": head.model}
    usage_null = {"usage": None} if head.include_usage else {}
    try:
        async for event in events:
            if isinstance(event, Delta) and event.content:
                yield responses.sse(responses.text_chunk(**ids, text=event.content, **usage_null))
            elif isinstance(event, Done):
                yield responses.sse(responses.text_chunk(**ids, text="", finish_reason=event.finish_reason,
                                                         **usage_null))
                if head.include_usage:
                    yield responses.sse(responses.text_usage_chunk(**ids, prompt_tokens=event.prompt_tokens,
                                                                   completion_tokens=event.completion_tokens))
    except Exception as exc:  # every failure after the first byte is the stream's last event
        yield stream_error(head, exc)
        return
    finally:
        await events.aclose()  # a client that left mid-stream: the pipeline settles it as cancelled
    yield responses.SSE_DONE


TEXT = Framing(parse_completion, _whole, _sse)
