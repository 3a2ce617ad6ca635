"""A legacy text completion (POST /v1/completions) as the pipeline carries it.

The pipeline's stages (gate, route, cache, count, reserve, call, settle) take a chat request. A text completion
enters them as a chat request of one user turn, the prompt, marked `prompt_format: "raw"`: the tier then gets the
prompt as it was sent, on its own /v1/completions, with no chat template (tier_call.py), and the cache keys on the
mark (cache/request_key.py's OUTPUT_PARAMS), so a completion never answers a chat request of the same text or the
other way round. Counting the prompt through the chat template overstates it by the template's few tokens, which
only makes the reservation a little larger; what is billed is what the tier counted.

Through the gateway the legacy integer `logprobs` is refused by name (the pipeline meters chat log-probabilities,
not the legacy shape), and `priority` too, as on the chat route: a tenant's plan sets its priority.
"""

from __future__ import annotations

from typing import Literal

from gateway.errors import InvalidRequest
from gateway.validation import parse_body, refuse_engine_only
from wire.chat_request import ChatCompletionRequest
from wire.completion_request import DEFAULT_MAX_TOKENS, CompletionRequest

# what a text completion shares with a chat request, carried over as it was sent
_SHARED = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "stop", "seed", "n",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format"}


class RawPromptRequest(ChatCompletionRequest):
    """A text completion in the pipeline: its one user turn is the prompt, sent to the tier without a template."""

    prompt_format: Literal["raw"] = "raw"


def parse_completion(body: bytes) -> RawPromptRequest:
    """The body as a text completion, carried as the pipeline carries it (400 naming the field otherwise)."""
    req = parse_body(body, CompletionRequest)
    if req.logprobs is not None:
        raise InvalidRequest("logprobs: unsupported parameter (log-probabilities of text completions are not served "
                             "through the gateway); remove it", param="logprobs", code="unsupported_parameter")
    refuse_engine_only(req)
    fields = req.model_dump(include=_SHARED & req.model_fields_set)
    fields["max_tokens"] = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    return RawPromptRequest.model_validate({**fields, "messages": [{"role": "user", "content": req.text}]})


def is_raw(req: ChatCompletionRequest) -> bool:
    return isinstance(req, RawPromptRequest)
