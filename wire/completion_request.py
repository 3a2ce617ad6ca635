"""The OpenAI legacy text-completions request (POST /v1/completions), as our engine accepts it.

Bounded and strict like the chat request (wire/chat_request.py), with the same sampling fields and limits. The
prompt is sent to the model as it is: no chat template. What the legacy API has and we serve:

- `prompt`: one string, or a list of exactly one string, not empty. A batch of prompts, and token-id prompts (a
  list of integers), are refused by name: one prompt is one request, as the gateway bills and schedules it.
- `max_tokens` defaults to 16, as in OpenAI's legacy API (and vLLM's), capped by what the context has left.
- `logprobs` is the legacy integer: the log-probabilities of that many most likely tokens at each position
  (0 to MAX_LOGPROBS, OpenAI's bound), returned in the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`).
- `echo` only `false`, `suffix` refused (no fill-in-the-middle), `n` and `best_of` only 1, `logit_bias` only `{}`;
  `presence_penalty` and `frequency_penalty` within [-2, 2], honoured as on the chat endpoint.
- vLLM's `top_k` and `priority`, as on the chat endpoint, and vLLM's `response_format` (the chat endpoint's
  shapes, wire/response_format.py): the completion is then JSON, and `stop` beside it is refused naming `stop`, as on
  the chat endpoint (a stop string would cut the JSON short: wire/chat_request.py's `stop_cuts`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from wire.chat_request import (
    MAX_SEED,
    MAX_TOKENS_BOUND,
    NO_STOP_IN_A_JSON_ANSWER,
    STREAM_OPTIONS_NEED_STREAM,
    GenerationRequest,
    Penalty,
    StopString,
    StreamOptions,
    Temperature,
)
from wire.fields import UNSUPPORTED_VALUE, nullable_optionals, only
from wire.response_format import ResponseFormat

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default
MAX_LOGPROBS = 5
MAX_STOP_SEQUENCES = 4
NonEmpty = Annotated[str, Field(min_length=1)]

UNSUPPORTED_FIELDS = {
    "suffix": "fill-in-the-middle (suffix) is not supported",
}


def _one_text_prompt(value: Any) -> Any:
    """`prompt` as the legacy API allows it, refused by name where it is a batch, token ids or empty (no token to
    continue from: the engine refused it, after the gateway had routed, reserved and sent it)."""
    if isinstance(value, list):  # its first item says what it is: the rest is not looked at (a million of them was)
        if value and isinstance(value[0], int | list) and not isinstance(value[0], bool):
            raise PydanticCustomError(UNSUPPORTED_VALUE, "token-id prompts are not supported; send the text")
        if len(value) > 1:
            raise PydanticCustomError(UNSUPPORTED_VALUE, "one prompt per request: send a string (or a list of one)")
    if value == "" or value == [""]:
        raise PydanticCustomError("string_too_short", "the prompt is empty; send the text to continue")
    return value


def completion_schema(schema: dict[str, Any]) -> None:
    """The request's JSON schema: optional fields take null, stream_options go with stream, and no stop string goes
    with a response_format that makes the completion JSON."""
    nullable_optionals(schema)
    schema["allOf"] = [STREAM_OPTIONS_NEED_STREAM, NO_STOP_IN_A_JSON_ANSWER]


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: one prompt, continued as it is (no chat template)."""

    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=completion_schema)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    prompt: Annotated[NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)],
                      Field(description="the text to continue (not empty): a string, or a list of exactly one string")]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS_BOUND)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[Literal[False], only(False, reason="echoing the prompt is not supported; send false")] = False
    n: Annotated[int, Field(ge=1, le=1), only(1, reason="one choice per request (n: 1)")] = 1
    best_of: Annotated[int, Field(ge=1, le=1), only(1, reason="best_of is not supported; send 1")] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, int], Field(max_length=0),
                          only({}, reason="logit_bias is not supported; send {} or leave it out")] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    response_format: ResponseFormat | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _one_text_prompt(value)

    @property
    def text(self) -> str:
        """The prompt's text."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
