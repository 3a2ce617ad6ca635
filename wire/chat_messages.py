"""A chat request's messages (`ChatMessage`, its content parts `TextPart`), as the gateway and our engine accept them.

Split from wire/chat_request.py, which holds the request around them (its sampling fields, its checks of one field
against another, the fields refused by name) and re-exports what its callers imported from it. Each message is
checked on its own: its role's fields (`tool_calls` only an assistant's, `tool_call_id` only and always a tool's),
content required but for an assistant message with tool calls (refused naming `messages.<i>.content`, as OpenAI
refuses it), at most MAX_CONTENT_PARTS parts, and the fields OpenAI returns on an assistant message accepted back
only when empty. Types are strict and `null` means unset, as for the request; the published JSON schema
(`_message_schema`) says the same. `SYSTEM_ROLES` and `normalized_role`: the roles as chat templates know them (read
by the cache key, the router's features, the replica affinity and wire/tool_calls.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from wire.fields import drop_nulls, nullable_optionals, one_unknown
from wire.tools import ToolCallId, ToolCalls

MAX_CONTENT_PARTS = 256

# Fields of an assistant message as OpenAI returns it, harmless when a client sends them back empty.
_ECHOED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")
_UNSET_WHEN_EMPTY = (*_ECHOED_MESSAGE_FIELDS, "tool_calls")  # `"tool_calls": []` is no call
_EMPTY = {"anyOf": [{"type": "null"}, {"const": ""}, {"type": "array", "maxItems": 0},
                    {"type": "object", "maxProperties": 0}]}
_HAS_CONTENT = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}


def _message_schema(schema: dict[str, Any]) -> None:
    """The message's schema: optional fields take null, the echoed fields are documented as empty only, and what
    `_tool_fields_with_their_roles` enforces."""
    nullable_optionals(schema)
    for name in _ECHOED_MESSAGE_FIELDS:
        schema["properties"][name] = {"description": "as OpenAI returns it; accepted only when empty", **_EMPTY}
    schema["allOf"] = [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
         "else": {"properties": {"tool_call_id": {"type": "null"}}}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}},
        # `_content_with_its_role` and `_tool_fields_with_their_roles`: content, or an assistant's tool calls
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}}, "then": _HAS_CONTENT,
         "else": {"anyOf": [_HAS_CONTENT, {"required": ["tool_calls"],
                                           "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}},
    ]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _one_unknown(cls, data: Any) -> Any:
        return one_unknown(data, cls)


ContentParts = Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS, fail_fast=True)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for an assistant message with tool calls (`_content_with_its_role`, `_tool_fields_with_their_roles`)
    content: Annotated[str | ContentParts | None, Field(validate_default=True)] = None
    # the participant's name: honoured where the model's chat template writes it, refused by name where not
    # (wire/tool_calls.py's `unrendered_name`, checked by our engines)
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: ToolCalls | None = None  # an assistant message's calls
    tool_call_id: ToolCallId | None = None  # a tool message: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data, _UNSET_WHEN_EMPTY), cls)

    @field_validator("content")
    @classmethod
    def _content_with_its_role(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI requires it; a message without it was answered as if it had said nothing (`role` absent: it failed)
        role = info.data.get("role", "assistant")
        if value is None and role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs `content`", {"role": role})
        return value

    @model_validator(mode="after")
    def _tool_fields_with_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has `tool_calls`")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs `content` or `tool_calls`")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs `tool_call_id`, and only a tool message has one")
        return self

    def text(self) -> str:
        """The message's text, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


SYSTEM_ROLES = ("system", "developer")  # OpenAI's `developer` is the `system` of templates that predate it


def normalized_role(role: str) -> str:
    """The role as chat templates know it: `developer` becomes `system` (wire/tool_calls.py renders `tool`)."""
    return "system" if role in SYSTEM_ROLES else role
