"""The OpenAI chat-completions request, as the gateway and our engine both accept it.

Pure pydantic (no torch), so the gateway validates with the same schema the engine serves, and the engine
validates again: neither trusts the other's caller. Types are strict (`"max_tokens": "5"` is a 400, not a
silent conversion), every number has bounds that keep the engine's arithmetic finite, and a field we do
not honour is refused by name, never dropped. A field sent as JSON `null` means "not set", as the OpenAI
SDKs send it, and is accepted whatever its name. The JSON schema these models generate (published in the
gateway's OpenAPI document) says all of this: what it accepts is what is served.

OpenAI's request fields, one by one (`OPENAI_FIELDS` lists them; a test sends each through the gateway):

- honoured: model, messages, stream, max_tokens, max_completion_tokens, temperature, top_p, stop, seed, logprobs,
  top_logprobs, user; presence_penalty and frequency_penalty (each within [-2, 2], as OpenAI's: our engines lower a
  token's logit by frequency_penalty times its count in the answer so far, and by presence_penalty once it is in it;
  every tier's server takes both, and gets them as they were sent, left out where 0); stream_options.include_usage
  (and vLLM's continuous_usage_stats); response_format (text, json_object, json_schema: wire/response_format.py; our
  engines enforce it by grammar-constrained decoding, remote tiers get it as it was sent); tools, tool_choice,
  parallel_tool_calls, and assistant `tool_calls` and `tool` messages (wire/tools.py: our engines render them into
  the prompt and parse the answer back into tool calls, at most one call per answer under `parallel_tool_calls:
  false`, wire/tool_calls.py; remote tiers get them as they were sent); a message's `name` (our engines hand it to
  the model's chat template, and refuse it, 400 naming `messages.<i>.name`, where that template does not write names
  into the prompt, as SmolLM2's does not; remote tiers get it as it was sent).
- honoured for the one value we serve: n (1), stream_options.include_obfuscation (false: stream events are not
  padded), store (false: nothing is stored for later retrieval), service_tier (auto or default: a tenant's priority
  and tiers come from its plan), prompt_cache_retention (in_memory, or in-memory as OpenAI first spelt it: the
  engines' prefix cache), verbosity (medium, the default), modalities (["text"]), logit_bias ({}).
- accepted, bounded, as hints that change no answer: prompt_cache_key (OpenAI's prefix-cache routing hint; our
  engines' prefix cache needs none), safety_identifier (the end user's id for abuse detection; `end_user` gives it
  where `user` is absent), metadata (16 pairs, keys of at most 64 characters, values of at most 512, as OpenAI's;
  as at OpenAI with `store` off, it labels nothing).
- refused by name (`UNSUPPORTED_FIELDS`): functions, function_call (the deprecated forms of tools), audio,
  prediction, web_search_options, reasoning_effort, moderation, prompt_cache_options.
- any other field is refused by name, vLLM's `top_k` and `priority` excepted (our engines honour them; through the
  gateway a plan sets the priority, so it refuses `priority`, and `top_k` above 0 goes only to tiers whose server
  samples by it, refused by name for a tier that does not: -1 and 0 turn it off).

A refused field is a 400 with `param` naming it and code `unsupported_parameter`; a refused value of a field we
know is a 400 with code `unsupported_value`. A field that needs another is refused, naming it, without it, as
OpenAI refuses it: `stream_options` without `stream: true`, `parallel_tool_calls` without `tools`, `top_logprobs`
(above 0) without `logprobs: true`; and `max_completion_tokens` that disagrees with `max_tokens`. A message without
`content` (null, absent, or no content parts) is refused naming `messages.<i>.content`, as OpenAI refuses it, but for
an assistant message that has `tool_calls`.

Choices where OpenAI's own limits are looser or unstated:
- `seed` must lie in 0..2^64-1 (what a 64-bit generator takes); any other integer is a 400 naming `seed`.
- `temperature` is 0 (greedy) or at least MIN_TEMPERATURE: below it, logits divided by the temperature
  leave float32's range and sampling is greedy anyway.
- `stop`: at most MAX_STOP_SEQUENCES strings of 1 to MAX_STOP_CHARS characters each. An empty one is refused by
  name (`_no_empty_stop`): servers do not agree on what it means (our engine matched it nowhere, vLLM refuses it, a
  server that looks for it in the text finds it at once and stops), so whichever tier answered, the answer depended
  on a field the tenant could not see honoured. Refused, it means the same on every tier.
- `stop` (one or more strings) with an answer whose shape the request sets is refused naming `stop`
  (`unsupported_value`, `_stop_keeps_the_shape`): with response_format json_object or json_schema, and with tools
  under any tool_choice but "none" ("required", a named function, or "auto", the default). A stop string met inside
  the JSON or the tool call ended the answer there, unparsed, and it read as complete (finish_reason "stop"): a
  schema's answer was `{`, a required call's was the start of its JSON as content, and under "auto" the call's
  `<tool_call>` wrapper was sent as the answer's text. Our engine matches stop strings in all of the text, and
  cannot tell a call's JSON from prose while it decodes; remote servers differ, so refused, it means the same on
  every tier. `stop: []`, null, or stop with response_format text or tool_choice "none" are accepted.
- `messages`: at most MAX_MESSAGES, with at most wire/body_width.MAX_ITEMS content parts and tool calls in all
  (looked at before validation: `look_before_validating`); the first bad item ends validation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from wire.body_width import MAX_MESSAGES, check_width
from wire.chat_messages import SYSTEM_ROLES as SYSTEM_ROLES  # re-exported, as `normalized_role`: callers import them
from wire.chat_messages import ChatMessage
from wire.chat_messages import normalized_role as normalized_role
from wire.fields import UNSUPPORTED_VALUE, drop_nulls, integral, nullable_optionals, one_unknown, only
from wire.response_format import ResponseFormat
from wire.tools import ToolChoice, Tools, check_tool_choice, must_call

MAX_SEED = 2**64 - 1
MIN_TEMPERATURE = 0.01
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie within [-MAX_PENALTY, MAX_PENALTY], as OpenAI's
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_TOKENS_BOUND = 2**31 - 1
MAX_METADATA_PAIRS = 16

# OpenAI request fields we know and do not honour yet: refused with this explanation.
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated function calling is not supported; send `tools`",
    "function_call": "the deprecated function calling is not supported; send `tool_choice`",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning models are not served here",
    "moderation": "moderation of the input and output is not run here",
    "prompt_cache_options": "prompt cache breakpoints and lifetimes are not supported; the engines' prefix cache "
                            "needs none",
}
# Every field of OpenAI's chat-completions request (its API reference, 2026): each is a field of
# ChatCompletionRequest (honoured, or restricted to the values we serve) or in UNSUPPORTED_FIELDS.
OPENAI_FIELDS = (
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
)
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=nullable_optionals)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, so a cancelled stream is countable
    include_obfuscation: Annotated[Literal[False], only(False, reason="stream events are not obfuscated here; "
                                                        "send false or leave it out")] = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)


def _no_empty_stop(value: Any) -> Any:
    """An empty stop string, refused in words (pydantic's own would say "at least 1 character")."""
    if value == "":
        raise PydanticCustomError("string_too_short", "a stop string may not be empty (it would stop nothing on one "
                                  "server and everything at once on another); remove it")
    return value


StopString = Annotated[str, BeforeValidator(_no_empty_stop), Field(min_length=1, max_length=MAX_STOP_CHARS)]
def _metadata_pairs(value: Any) -> Any:
    """More than MAX_METADATA_PAIRS pairs refused before any is looked at: each was first (an error for each whose
    value was not a string: 200,000 of them cost the event loop 0.9 s to refuse)."""
    if isinstance(value, dict) and len(value) > MAX_METADATA_PAIRS:
        raise PydanticCustomError("too_long", "at most {n} pairs", {"n": MAX_METADATA_PAIRS})
    return value


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
# presence_penalty, frequency_penalty: OpenAI's range (a positive one makes a token already in the answer less likely)
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# 0 (greedy) or at least MIN_TEMPERATURE (`_temperature_is_safe`), and the document says so
Temperature = Annotated[float, Field(ge=0.0, le=2.0), WithJsonSchema({"anyOf": [
    {"type": "number", "minimum": 0, "maximum": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 2}]})]


# the published schema's rule for what `_stream_options_need_stream` enforces (chat and text completions)
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
# the published schema's rule for what `_stop_keeps_the_shape` enforces: no stop string beside a response_format that
# makes the answer JSON, nor (chat only) beside tools a call may be made of (any tool_choice but "none")
_SOME_STOP = {"required": ["stop"], "properties": {"stop": {"anyOf": [{"type": "string"},
                                                                       {"type": "array", "minItems": 1}]}}}
_JSON_FORMAT = {"required": ["response_format"], "properties": {"response_format": {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
_CALLABLE_TOOLS = {"required": ["tools"], "properties": {"tools": {"type": "array"}},
                   "not": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}}}
NO_STOP_IN_A_JSON_ANSWER = {"not": {**_SOME_STOP, "anyOf": [_JSON_FORMAT]}}
NO_STOP_IN_A_SHAPED_ANSWER = {"not": {**_SOME_STOP, "anyOf": [_JSON_FORMAT, _CALLABLE_TOOLS]}}


def stop_cuts(response_format: ResponseFormat | None, tools: list[Any] | None, tool_choice: ToolChoice | None) -> \
        str | None:
    """Why a stop string would cut this answer short, in words: its response_format makes it JSON, or tools may be
    called in it; None where neither (a stop string then ends prose, as it should)."""
    if response_format is not None and response_format.constrains:
        return (f"a stop sequence would cut the JSON short: response_format {response_format.type} makes the answer "
                "JSON, and a stop string met inside it would end the answer there, unfinished, reading as complete "
                "(finish_reason \"stop\"); remove stop, or response_format")
    if tools and tool_choice != "none":
        how = ("tool_choice 'required' makes the answer a tool call" if tool_choice == "required" else
               "a named tool_choice makes the answer a call of that function" if must_call(tool_choice) else
               "with tools and tool_choice 'auto' (the default) the model may answer with a tool call")
        return (f"a stop sequence would cut the tool call short: {how}, and a stop string met inside the call's JSON "
                "would end the answer there, the call unparsed and sent as text, reading as complete "
                "(finish_reason \"stop\"); remove stop, or send tool_choice 'none'")
    return None


def request_schema(schema: dict[str, Any]) -> None:
    """The request's JSON schema: optional fields take null, what `_top_logprobs_need_logprobs` enforces, tools for
    a tool_choice that needs them, and one output cap (`_one_token_cap` also accepts both when they are equal, as a
    client mirroring them sends them; JSON Schema cannot compare two values, so the document asks for one); then
    stream_options only with stream, parallel_tool_calls only with tools, and no stop string in a JSON answer or
    beside tools that may be called."""
    nullable_optionals(schema)
    schema["allOf"] = [{
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }, {
        "not": {"required": ["max_tokens", "max_completion_tokens"],
                "properties": {"max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}},
    }, {  # "required" and a named function need tools (a named one must be one of them: `_choice_in_tools`)
        "if": {"required": ["tool_choice"],
               "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array"}}},
    }, STREAM_OPTIONS_NEED_STREAM, {
        "if": {"required": ["parallel_tool_calls"], "properties": {"parallel_tool_calls": {"type": "boolean"}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array"}}},
    }, NO_STOP_IN_A_SHAPED_ANSWER]


class GenerationRequest(BaseModel):
    """What chat and text completions (wire/completion_request.py) share: `null` means unset, the checks of the
    sampling fields, and the stop strings and usage options as the engine reads them. The fields themselves are
    each request's own (their bounds and order in the published schema)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before",
                     check_fields=False)
    @classmethod
    def _ints_are_numbers(cls, value: object) -> object:
        # JSON has one number type; `"temperature": 0` is as valid as 0.0 (bools are not numbers). An integer past
        # float's range stays one, for the field's bound to refuse (float() raised OverflowError: a 500)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1023:
            return float(value)
        return value

    @field_validator("temperature", check_fields=False)
    @classmethod
    def _temperature_is_safe(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "priority", "top_logprobs",
                     "logprobs", "best_of", mode="before", check_fields=False)
    @classmethod
    def _integral(cls, value: object) -> object:
        return integral(value)

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI refuses them on an answer that is not streamed; `stream` absent from `info.data` failed on its own
        if value is not None and info.data.get("stream", True) is False:
            raise ValueError("only allowed when stream is true (usage options are for streamed answers)")
        return value

    @model_validator(mode="after")
    def _stop_keeps_the_shape(self) -> GenerationRequest:
        # after every field, as it needs three that come after `stop`; refused naming `stop`, the field to drop
        why = stop_cuts(getattr(self, "response_format", None), getattr(self, "tools", None),
                        getattr(self, "tool_choice", None)) if self.stop_list else None
        if why is not None:
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError(UNSUPPORTED_VALUE, why), loc=("stop",),
                input=self.stop)])  # type: ignore[attr-defined]
        return self

    @property
    def stop_list(self) -> list[str]:
        stop = self.stop  # type: ignore[attr-defined]
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    @property
    def include_usage(self) -> bool:
        options = self.stream_options  # type: ignore[attr-defined]
        return bool(options and options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options  # type: ignore[attr-defined]
        return bool(options and options.continuous_usage_stats)


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. Fields we cannot honour are refused, never silently ignored."""

    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS
    # the body's width, before validation builds an object per part (wire/validation.parse_body calls it)
    look_before_validating: ClassVar[Callable[[bytes], bool]] = staticmethod(check_width)
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=request_schema)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS_BOUND)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=1), only(1, reason="one choice per request (n: 1)")] = 1
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS),
                        BeforeValidator(_metadata_pairs)] | None = None
    store: Annotated[Literal[False], only(False, reason="completions are not stored here; send false")] | None = None
    service_tier: Annotated[Literal["auto", "default"], only(
        "auto", "default", reason="only 'auto' and 'default': your plan sets your priority and tiers")] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    # "in_memory" as the OpenAI SDKs type it, "in-memory" as OpenAI's API reference first wrote it
    prompt_cache_retention: Annotated[Literal["in_memory", "in-memory"], only(
        "in_memory", "in-memory", reason="only 'in_memory': the prefix cache lives in the engines' memory",
    )] | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    verbosity: Annotated[Literal["medium"], only("medium", reason="verbosity control is not supported; "
                                                 "only 'medium' (the default)")] | None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1),
                          only(["text"], reason="only text output is supported: ['text']")] | None = None
    logit_bias: Annotated[dict[str, int], Field(max_length=0),
                          only({}, reason="logit_bias is not supported; send {} or leave it out")] | None = None
    response_format: ResponseFormat | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # after `tools`: its check reads them
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        return check_tool_choice(value, info.data.get("tools"))

    # the checks of one field against an earlier one are the later field's validators, so a refusal names it;
    # an earlier field absent from `info.data` failed on its own, and is the one named
    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel_calls_need_tools(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is not None and "tools" in info.data and not info.data["tools"]:
            raise ValueError("only allowed when tools are specified")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("logprobs", True) is False:
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_cap(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError("disagrees with max_tokens; send one of them")
        return value

    @property
    def output_cap(self) -> int | None:
        """The requested output-token cap, from either field."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def uses_tools(self) -> bool:
        """The request offers tools or carries a tool exchange (tool calls, tool results)."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def end_user(self) -> str | None:
        """Who the answer is for, as the client names them: `user`, else `safety_identifier`."""
        return self.user or self.safety_identifier


def unsupported_reason(field: str) -> str:
    """Why the request field `field` is refused: a known unsupported field's reason, else unknown."""
    return UNSUPPORTED_FIELDS.get(field, "it is not a chat-completions parameter this server knows")
