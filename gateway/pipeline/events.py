"""What the pipeline hands the route for one answer, in order: `Head`, any number of `Delta`s, `Done`.

A streamed response frames each as server-sent events; a non-streamed one folds them into one JSON
completion. `Head` comes only once the answer has started (the tier's first chunk, or the cached answer),
so a failure before it is still an HTTP error status. `Done` comes only once the ledger row is durable, but for a JSON
answer's (`Delivery`): that one comes before its attempt settles, and the route builds its body then, sending it once
the events have ended, its row durable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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


class Delivery:
    """A JSON answer's fate at its route, told to the pipeline before the answer's attempt settles. The route builds
    the body at the answer's `Done`, which comes before that settle for a JSON answer (not one a cascade reads whole
    first: its `Done` carries none), and reads on; a body that failed to build is `failed`, and the attempt settles as
    that error, billed nothing, no answer kept (gateway/pipeline/handle.py). Built after the settle, as it was, such a
    body's client got a 500 for an answer billed, counted ok, cached and replayed to its Idempotency-Key."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed: Exception | None = None


@dataclass(frozen=True)
class Done:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    delivery: Delivery | None = field(default=None, compare=False)  # a JSON answer's, not yet settled

    def not_sent(self, exc: Exception) -> Exception:
        """The route could not build this answer's body (`exc`): told to the pipeline, which settles the attempt as
        that error where it has not settled yet (`delivery`). Returns `exc`, for the route to raise once the events
        have ended, as the pipeline will not where the attempt had settled."""
        if self.delivery is not None:
            self.delivery.failed = exc
        return exc


Event = Head | Delta | Done
