"""The answers' shapes, as pydantic models: what the OpenAPI document promises the builders of wire/responses.py
(and wire/embeddings.py, wire/errors.py) produce. Only documentation and tests use them; answers are built as dicts.

They allow more than they name (no `additionalProperties: false`): OpenAI adds fields to its answers over time,
clients ignore what they do not know, and ours carry extras (`x_tiergate`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error, OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None  # the answer calls these functions (finish_reason "tool_calls")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None


class ChatCompletion(BaseModel):
    """A whole chat completion; with `"stream": true` the answer is instead `text/event-stream`: `data:` lines
    of `chat.completion.chunk` objects, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None


class TextCompletion(BaseModel):
    """A whole legacy text completion; with `"stream": true` the answer is instead `text/event-stream`: `data:`
    lines of `text_completion` objects (each choice's `text` the next piece), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (`encoding_format: base64`)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    capabilities: list[str]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
