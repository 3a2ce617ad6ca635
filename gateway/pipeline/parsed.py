"""A deterministic request sent again by the same key is parsed once: the repeats that exact cache hits answer.

Parsing a chat body (pydantic's validation, with the body read as JSON first: wire/validation.py) is the largest
single cost an exact hit pays of its own, ~15-25 us of a short body on one core, and a repeat of the same bytes
parses to the same request every time. The parsed requests of the last `ENTRIES` deterministic bodies (temperature 0
or a seed: the requests the cache may answer) are kept, each by the key that sent it, the parser that read it and
the body's bytes, and a repeat gets a copy of the kept request.

- By key: one key's bodies are never another's, so whether a body was sent lately is not told across keys (a hit
  here answers some microseconds sooner) and a tenant's flood of new bodies pushes out what it and others sent, and
  nothing else.
- A copy (`model_copy`): what a request's stages assign on theirs is not the next one's. Nothing in the pipeline
  changes a request in place (a stage that needs another builds it: `model_copy(update=...)`), which is what makes
  sharing the nested values safe.
- Only what parsed: a body refused (400) is parsed, and refused, again at every try. Bodies over `MAX_BODY` bytes
  are parsed every time (the dict's hash of a long body would cost a part of what it saves, for what is rarely sent
  twice), and so are those the cache never answers (temperature unset or above 0 without a seed: nothing a repeat
  could save them but their parse).
- What a later stage derives from the request alone, once for all its repeats (`Derived`: the cache's keys, ~10 us
  of an exact hit's hashing, gateway/pipeline/cache_lookup.py), given to a request that holds the kept request's
  own values: one a stage assigned a field on (none does) is derived anew.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from cache.request_key import sampling_class
from wire.chat_request import ChatCompletionRequest

ENTRIES = 512  # parsed requests kept, all keys'
MAX_BODY = 16 * 1024  # bytes: longer bodies are parsed every time
# at most ENTRIES * MAX_BODY = 8 MB of bodies held, and their parsed requests (their texts again, about as much);
# what is derived from them (`Derived`: the cache's dump of the request shares its strings, and a few hashes) adds
# their dicts, not their texts

Parse = Callable[[bytes], ChatCompletionRequest]


class Derived:
    """What stages derived from a kept request, by name, for every request parsed from its body (`ParsedBodies`):
    each value a function of the request alone, computed by the first request that needs it."""

    __slots__ = ("_memo", "_values")

    def __init__(self, kept: ChatCompletionRequest) -> None:
        self._values = tuple(kept.__dict__.values())  # the kept request's, which its copies share (a shallow copy)
        self._memo: dict[str, Any] = {}

    def of(self, req: ChatCompletionRequest) -> dict[str, Any] | None:
        """The memo, where `req` holds the kept request's values (each the same object: no field assigned since
        its copy); None otherwise (derive anew, and keep nothing)."""
        values = req.__dict__.values()
        if len(values) == len(self._values) and all(map(operator.is_, values, self._values)):
            return self._memo
        return None


class ParsedBodies:
    """The requests parsed from the last deterministic bodies, by (key id, parser, body). Event loop only."""

    def __init__(self, entries: int = ENTRIES, max_body: int = MAX_BODY) -> None:
        if entries < 1:
            raise ValueError("entries must be at least 1")
        self.entries = entries
        self.max_body = max_body
        self._kept: OrderedDict[tuple[str, Parse, bytes], tuple[ChatCompletionRequest, Derived]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def parse(self, key_id: str, parse: Parse, body: bytes) -> ChatCompletionRequest:
        """`parse(body)`, or a copy of what it gave for the same key and bytes lately; raises what `parse` raises."""
        return self.parse_kept(key_id, parse, body)[0]

    def parse_kept(self, key_id: str, parse: Parse, body: bytes) -> tuple[ChatCompletionRequest, Derived | None]:
        """`parse`, and what stages derive from the request once for its body's repeats (None: not kept)."""
        if len(body) > self.max_body:
            return parse(body), None
        key = (key_id, parse, body)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept[0].model_copy(), kept[1]
        req = parse(body)
        if not _deterministic(req):
            return req, None
        copy = req.model_copy()  # what the caller gets is its own too
        derived = Derived(copy)
        self._kept[key] = copy, derived
        if len(self._kept) > self.entries:
            self._kept.popitem(last=False)
        return req, derived


def _deterministic(req: ChatCompletionRequest) -> bool:
    """A request the cache may answer: one whose sampling class (greedy, or seeded) is not "sampled"."""
    return sampling_class({"temperature": req.temperature, "seed": req.seed}) != "sampled"
