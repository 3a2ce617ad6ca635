"""The OpenAI chat-completions request, as the gateway and our engine both accept it.

Pure pydantic (no torch), so the gateway validates with the same schema the engine serves, and the engine
validates again: neither trusts the other's caller. Types are strict (`"max_tokens": "5"` is a 400, not a
silent conversion), every number has bounds that keep the engine's arithmetic finite, and a field we do
not honour is refused by name (`unsupported_parameter`), never dropped. A field sent as JSON `null` means
"not set", as the OpenAI SDKs send it, and is accepted whatever its name.

Choices where OpenAI's own limits are looser or unstated:
- `seed` must lie in 0..2^64-1 (what a 64-bit generator takes); any other integer is a 400 naming `seed`.
- `temperature` is 0 (greedy) or at least MIN_TEMPERATURE: below it, logits divided by the temperature
  leave float32's range and sampling is greedy anyway.
- `stop`: at most MAX_STOP_SEQUENCES strings of at most MAX_STOP_CHARS characters each.
- `messages`: at most MAX_MESSAGES.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**64 - 1
MIN_TEMPERATURE = 0.01
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_TOKENS_BOUND = 2**31 - 1

# OpenAI request fields we know and do not honour yet: refused with this explanation.
UNSUPPORTED_FIELDS = {
    "tools": "tool calling is not supported yet",
    "tool_choice": "tool calling is not supported yet",
    "parallel_tool_calls": "tool calling is not supported yet",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output (response_format) is not supported yet",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning models are not served here",
}
# Fields of an assistant message as OpenAI returns it, harmless when a client sends them back empty.
_ECHOED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call", "tool_calls")


def _drop_nulls(data: Any, echoed: tuple[str, ...] = ()) -> Any:
    """A JSON object without its `null` fields (and without `echoed` fields that are empty)."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None and not (k in echoed and v in ([], {}, ""))}


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return _drop_nulls(data, _ECHOED_MESSAGE_FIELDS)

    def text(self) -> str:
        """The message's text, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, so a cancelled stream is countable


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Fields we cannot honour are refused, never silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS_BOUND)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return _drop_nulls(data)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _ints_are_numbers(cls, value: object) -> object:
        # JSON has one number type; `"temperature": 0` is as valid as 0.0 (bools are not numbers)
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_is_safe(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _one_token_cap(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def output_cap(self) -> int | None:
        """The requested output-token cap, from either field."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


SYSTEM_ROLES = ("system", "developer")  # OpenAI's `developer` is the `system` of templates that predate it


def normalized_role(role: str) -> str:
    """The role as chat templates know it: `developer` becomes `system`."""
    return "system" if role in SYSTEM_ROLES else role


def unsupported_reason(field: str) -> str:
    """Why the request field `field` is refused: a known unsupported field's reason, else unknown."""
    return UNSUPPORTED_FIELDS.get(field, "it is not a chat-completions parameter this server knows")
