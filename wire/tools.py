"""OpenAI's tool-calling fields, as the gateway and our engine both accept them.

- `tools`: at most MAX_TOOLS functions (`{"type": "function", "function": {name, description?, parameters?,
  strict?}}`), MAX_TOOLS_BYTES of JSON in all. `parameters` is a JSON Schema a grammar compiler may read (our
  engines constrain `required` and named choices with it), so it has response_format's bounds
  (wire/response_format.py). The total bound is checked on the raw list, before any tool is validated: with
  `tool_choice: "none"` no tool is rendered into the prompt or counted, so 4 MB of tools (128 of 32 KB) were
  accepted for the price of "hi", then parsed, hashed and forwarded on the gateway's event loop and parsed again
  on the engine's (another tenant's p50 went from 0.12 to 1.67 s under four such clients).
- `tool_choice`: "none", "auto", "required", or `{"type": "function", "function": {"name"}}` naming one of `tools`;
  "required" and a named function need `tools`.
- `parallel_tool_calls`: whether the model may call several functions in one answer.
- in messages: an assistant message's `tool_calls` (its `content` may then be null), and `tool` messages that
  answer one of them (`tool_call_id`).

Anything else is a 400 naming the field (`tools.3.function.name`, `tool_choice`, `messages.2.tool_call_id`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from wire.fields import drop_nulls, nullable_optionals, one_unknown
from wire.response_format import MAX_DESCRIPTION_CHARS, NO_COMPILER_OPTIONS, SCHEMA_BOUNDS, check_schema_bounds
from wire.schema_alternatives import MAX_INTERSECTION_WEIGHT, check_alternatives, may_intersect

MAX_TOOLS = 128  # as OpenAI's
MAX_TOOLS_BYTES = 256 * 1024  # every tool as compact JSON, together: a tool-calling prompt of this size is ~64K tokens
MAX_TOOL_CALLS = 128  # calls in one assistant message
MAX_TOOL_CALL_ID_CHARS = 256
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME,
                                    description="a-z, A-Z, 0-9, underscores and dashes, at most 64 characters")]
ToolCallId = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)


class FunctionDefinition(_Model):
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: Annotated[dict[str, Any], Field(description=SCHEMA_BOUNDS,
                                                json_schema_extra=NO_COMPILER_OPTIONS)] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_schema_bounds(value)
        return value


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    """`{"type": "function", "function": {"name": …}}`: the answer calls this function."""

    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
def _tools_bytes_bounded(value: Any) -> Any:
    """The raw `tools` list, refused whole past MAX_TOOLS_BYTES of compact JSON (msgspec: a few ms for 4 MB)."""
    if isinstance(value, list):
        try:
            size = len(msgspec.json.encode(value))
        except (TypeError, msgspec.EncodeError):  # not JSON values: the item validation names what is wrong
            return value
        if size > MAX_TOOLS_BYTES:
            raise ValueError(f"the tools have {size} bytes of JSON together; at most {MAX_TOOLS_BYTES} are allowed")
    return value


def _tools_intersections_bounded(tools: list[Tool]) -> list[Tool]:
    """The tools' schemas' intersections together (a required or named tool_choice compiles them as one grammar):
    each tool within its own bound, twelve of them took a compiler 3.9 s (wire/schema_alternatives.py)."""
    weight = sum(check_alternatives(t.function.parameters) for t in tools
                 if t.function.parameters is not None and may_intersect(msgspec.json.encode(t.function.parameters)))
    if weight > MAX_INTERSECTION_WEIGHT:
        raise ValueError(f"the tools' parameters intersect {weight} alternatives together; at most "
                         f"{MAX_INTERSECTION_WEIGHT} are allowed")
    return tools


Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS, fail_fast=True),
                  BeforeValidator(_tools_bytes_bounded), AfterValidator(_tools_intersections_bounded)]


class FunctionCall(_Model):
    name: Annotated[str, Field(max_length=256)]
    arguments: str  # JSON, as the model wrote it (a client sends back what it got)


class ToolCall(_Model):
    """One call of an assistant message, as OpenAI returns it and a client sends it back."""

    id: ToolCallId
    type: Literal["function"]
    function: FunctionCall


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS, fail_fast=True)]


def check_tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> ToolChoice | None:
    """ValueError for a choice that `tools` cannot satisfy: "required" or a named function without tools, or a
    name that is not one of them."""
    if choice is None or choice in ("none", "auto"):
        return choice
    names = [t.function.name for t in tools or ()]
    if not names:
        raise ValueError("tool_choice 'required' or a named function needs `tools`")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in `tools`")
    return choice


def offered_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool]:
    """The functions the model may call for this request: none under tool_choice "none", the named one under a
    named choice, else all of `tools`."""
    if not tools or choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return list(tools)


def must_call(choice: ToolChoice | None) -> bool:
    """The answer must be a tool call ("required", or a named function)."""
    return choice == "required" or isinstance(choice, NamedToolChoice)
