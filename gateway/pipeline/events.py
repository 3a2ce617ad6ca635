"""What the pipeline hands the route for one answer, in order: `Head`, any number of `Delta`s, `Done`.

A streamed response frames each as server-sent events; a non-streamed one folds them into one JSON
completion. `Head` comes only once the answer has started (the tier's first chunk, or the cached answer),
so a failure before it is still an HTTP error status. `Done` comes only once the ledger row is durable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Head:
    response_id: str  # `chatcmpl-<request id>`: the client's id for the whole answer, cascades included
    created: int
    model: str  # the tier that answers
    headers: Mapping[str, str]  # x-tiergate-*, x-ratelimit-*
    stream: bool  # the client asked for server-sent events
    include_usage: bool  # ...with a last chunk that carries the usage


@dataclass(frozen=True)
class Delta:
    content: str
    logprobs: list[dict[str, Any]] | None  # OpenAI's `logprobs.content` entries of this piece, when asked
    # OpenAI's stream `delta.tool_calls` entries of this piece (index, and id, type, name or a piece of arguments)
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Done:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


Event = Head | Delta | Done
