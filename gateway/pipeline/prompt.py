"""Prompt: what the tier will be asked, counted with its own tokenizer; the output cap; the context check.

Counting reads everything the tenant sent, so it is bounded and linear, and runs off the event loop:
- a prompt with more characters than `context × longest token` cannot fit and is refused unread;
- a long prompt is first counted on a prefix of `context × PREFIX_CHARS_PER_TOKEN` characters, and refused
  when that prefix alone overflows (a typical 4-character token makes that a few tens of kilobytes);
- the ladder's `cap_input_tokens` drops the oldest turns in one pass: turns that cannot fit by their length
  alone are dropped unread, the others are counted once each (`encode_batch`, one call) plus the template's
  per-message markers, and the result is checked with one exact count (another turn dropped if the estimate
  was short);
- small prompts are counted inline (microseconds); larger ones in a worker thread, where the tokenizer
  releases the GIL (gateway/token_counter.py), so the event loop serves other requests meanwhile. Small is few
  characters and few messages: the template writes its markers around every message, so 2,048 empty messages
  (a 70 KB body) are a 57 KB prompt of 10k tokens, which took the event loop 27-42 ms to render and count.
- `size`, before any of that, reads only lengths: whether the count is short (inline), and a long prompt's floor
  (a token covers at most `max_token_chars` characters; its max_tokens as capped), which the pipeline holds
  reserved while it is counted, so a tenant that cannot have even the floor is refused before its count
  (gateway/pipeline/handle.py).

Tools count as our engine renders them (wire/tool_calls.py): the functions' JSON in the system message, calls and
results as text, one turn per message (the engine joins consecutive results into one turn, a few tokens fewer).
A remote tier's own template renders them otherwise; the count is its estimate for the reservation, and what is
billed is what the tier counted. A tenant's spelling of our markers (`<tool_call>`) is counted as the text our engine
reads it as: the turns are made with the counter's `marker_escape` (gateway/token_counter.py).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from assets.model_source import DEFAULT_MODEL, resolve_model
from gateway.errors import InvalidRequest, Unavailable
from gateway.fair_threads import FairThreads
from gateway.ladder.apply import Degradation
from gateway.pipeline.text_completion import is_raw
from gateway.token_counter import TokenCounter, token_counter
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest, ChatMessage
from wire.prompt_text import MarkerEscape
from wire.tool_calls import preamble, turn, with_preamble

PREFIX_CHARS_PER_TOKEN = 8  # a prefix this many characters per context token is counted first
INLINE_CHARS = 4096  # prompts up to this many characters are counted on the event loop
INLINE_MESSAGES = 32  # ...and of up to this many messages (each adds the template's markers: ~0.5 ms for 32 empty)
PREFIX_MARGIN_TOKENS = 16  # a prefix cut inside a word may count a few tokens more than the whole
MAX_RECOUNTS = 4  # exact counts the input cap may take after its estimate
COUNTING_THREADS = 2  # threads that count long prompts (and embeddings inputs), tenants in turn


log = logging.getLogger("tiergate.prompt")


@dataclass(frozen=True)
class Prompt:
    messages: tuple[ChatMessage, ...]  # after the ladder's input cap
    num_tokens: int  # the rendered prompt's tokens, as the tier's engine will count them
    output_cap: int  # output tokens reserved (and sent as max_tokens)
    cap_by_context: bool  # the cap is what the context had left, not what the client asked
    applied: tuple[str, ...]  # the ladder's actions that changed it


class Unread(NamedTuple):  # (a tuple: built for every request, in half a dataclass's time)
    """A prompt before its count (`PromptStage.size`): its turns as the template reads them, and what counting costs."""

    counter: TokenCounter  # its tier's
    messages: list[dict[str, Any]]  # `turn` of each message
    tools: str  # the system-message text our engines add (its tools, or its JSON format's description: preamble)
    chars: int  # its turns' and tools' characters
    inline: bool  # short: counted on the event loop in microseconds, as cheap as a reservation
    floor_input: int  # a long one's fewest prompt tokens (a token covers at most `max_token_chars` characters)
    floor_output: int  # and output tokens (its max_tokens as the ladder caps it; else 1): 0 for a short one
    markers: MarkerEscape | None = None  # what `messages` and `tools` were escaped with (a chat request's, if any)

    @property
    def floor(self) -> int:
        return self.floor_input + self.floor_output


def tokenizer_source(tier: TierSpec) -> str:
    """The model whose tokenizer counts this tier's prompts: its own for local tiers, else the default's."""
    return tier.tokenizer or (tier.model if tier.backend == "local" else DEFAULT_MODEL)


class PromptStage:
    def __init__(self, *, models_dir: Path, default_max_tokens: int) -> None:
        self.models_dir = models_dir
        self.default_max_tokens = default_max_tokens
        # where long prompts are counted, tenants in turn: not asyncio's default threads, which every tenant's cache
        # lookups use (a temperature-0 request waited seconds behind another tenant's long prompts there)
        self.threads = FairThreads(COUNTING_THREADS, "tiergate-count")
        self._counters: dict[str, TokenCounter] = {}  # tokenizer source -> its counter, once loaded
        self._unprepared: dict[str, str] = {}  # tokenizer source -> why it last failed to load, as logged

    def size(self, req: ChatCompletionRequest, tier: TierSpec, degr: Degradation) -> Unread:
        """The prompt before its count: whether counting it is cheap, and, for one that is not, the fewest tokens its
        reservation can hold (`Unread.floor_input`, `floor_output`). A prompt that cannot fit by its length alone is
        refused here, unread. Costs a pass over the turns' lengths, which `measure` then reuses."""
        counter = self._counter(tier)
        markers = None if is_raw(req) else counter.marker_escape()  # a text completion's markers are the tenant's
        messages = [turn(m, markers) for m in req.messages]
        tools = preamble(req, markers)
        chars = sum(len(m["content"]) for m in messages) + len(tools)
        if chars <= INLINE_CHARS and len(messages) <= INLINE_MESSAGES:
            return Unread(counter, messages, tools, chars, True, 0, 0, markers)
        limit = tier.context_limit
        kept = chars  # the characters no input cap drops: its system turns, its last turn and its tools
        if degr.input_cap is not None:
            kept = sum(len(m["content"]) for m in messages[:-1] if m["role"] == "system") + len(tools)
            kept += len(messages[-1]["content"]) if messages else 0
        elif chars > limit * counter.max_token_chars:
            raise _too_long(tier, f"{chars} characters, more than {limit} tokens can hold", 0)  # read no further
        output = degr.cap_output(req.output_cap)[0] if req.output_cap else 1
        return Unread(counter, messages, tools, chars, False, -(-kept // counter.max_token_chars), output, markers)

    async def measure(self, req: ChatCompletionRequest, tier: TierSpec, degr: Degradation, *,
                      owner: Hashable = None, user: Hashable = None, unread: Unread | None = None) -> Prompt:
        """The prompt as `tier` will read it; a long one is counted in `owner`'s turn (the tenant's). Counts the
        counter remembers are `owner`'s own (gateway/token_counter.py): never another tenant's, nor, for the end
        user `user` a plan isolates (`isolated_user`), another end user's. `unread`: its `size` for this tier."""
        unread = unread or self.size(req, tier, degr)
        counter, messages, tools = unread.counter, unread.messages, unread.tools
        tokenized: int | None = None  # characters tokenized to count it (None: a short prompt's, found on refusal)
        as_text = not is_raw(req)  # a text completion's markers are the engine's tokens; a chat message's are text
        if unread.inline and degr.input_cap is None:
            rendered = with_preamble(messages, tools)
            num_tokens = counter.prompt_tokens(rendered, owner, user, specials_as_text=as_text, markers=unread.markers)
            kept, applied = list(req.messages), ()
        else:
            args = (counter, list(req.messages), messages, tier, degr.input_cap, tools, owner, user, as_text,
                    unread.markers)
            kept, applied, num_tokens, tokenized = await self.threads.run(owner, _count_bounded, *args)
        room = tier.context_limit - num_tokens
        cap = req.output_cap or max(1, min(self.default_max_tokens, room))
        by_context = req.output_cap is None and cap == room
        capped, action = degr.cap_output(cap)
        if action is not None:
            applied = (*applied, action)
        if num_tokens + capped > tier.context_limit:
            if tokenized is None:  # a short prompt (at most INLINE_MESSAGES turns): rendered again in microseconds
                tokenized = len(counter.render(rendered))
            raise _too_long(tier, f"{num_tokens} prompt tokens + {capped} output tokens", tokenized)
        return Prompt(tuple(kept), num_tokens, capped, by_context and capped == cap, applied)

    def warm(self, tiers: Iterable[TierSpec]) -> list[str]:
        """Load every tier's tokenizer and count a prompt with it (a worker thread, before the gateway takes
        requests): loading one reads its files (about 0.2 s of CPU), which the first request of each tier would
        otherwise pay on the event loop, stalling every request of the process. Returns the tokenizers loaded;
        one that is not prepared (a student not yet built), or that fails, is left for the request path to load
        and report: a warm-up never stops the gateway from starting."""
        loaded: dict[str, None] = {}
        for tier in tiers:
            try:
                self._counter(tier).prompt_tokens([{"role": "user", "content": "warm up"}])
            except Unavailable:
                continue
            except Exception as exc:  # a chat template that cannot count one user turn: requests will say so
                log.warning("could not warm the tokenizer of tier %r: %r", tier.name, exc)
                continue
            loaded[tokenizer_source(tier)] = None
        return list(loaded)

    def _counter(self, tier: TierSpec) -> TokenCounter:
        source = tokenizer_source(tier)
        counter = self._counters.get(source)  # (the model's path resolved and hashed cost ~3 us a request)
        if counter is not None:
            return counter
        try:
            counter = token_counter(resolve_model(source, self.models_dir))
        except (OSError, ValueError) as exc:
            # why (the file's path in the models directory, the loader's words) and what to run are the operator's:
            # logged once a fault, not once a request; the tenant reads which tier cannot take its request
            # the command that prepares it: a distilled student's build (`serve` starts it on first use, so until
            # it ends this is expected: a warning), else the fetch of its files
            built = tier.distill is not None and source == tier.model and tier.prepared_by
            why = f"{exc}; run `{built or f'tiergate models fetch --model {source}'}`"
            if self._unprepared.get(source) != why:
                self._unprepared[source] = why
                log.log(logging.WARNING if built else logging.ERROR, "the tokenizer of tier %r (%s) is not prepared%s: "
                        "%s", tier.name, source, " (its student model is built on first use)" if built else "", why)
            raise Unavailable(f"tier {tier.name!r} cannot take requests now: its model is not prepared on this "
                              "gateway; retry later", code="tokenizer_unavailable", retry_after=30) from exc
        self._unprepared.pop(source, None)
        self._counters[source] = counter  # only a loaded one: a tokenizer not prepared yet is looked for again
        return counter


def _count_bounded(counter: TokenCounter, originals: list[ChatMessage], messages: list[dict[str, Any]],
                   tier: TierSpec, input_cap: int | None, tools: str = "", owner: Hashable = None,
                   user: Hashable = None, specials_as_text: bool = True, markers: MarkerEscape | None = None,
                   ) -> tuple[list[ChatMessage], tuple[str, ...], int, int]:
    """(messages kept, actions applied, prompt tokens, characters tokenized), reading at most what could fit (worker
    thread). `tools`: the system-message text our engines add (`preamble`), counted with the system message;
    `owner`: the tenant whose remembered counts (its end user `user`'s) may be reused; `specials_as_text`: as
    TokenCounter.prompt_tokens (False for a text completion's prompt); `markers`: what the turns were escaped with
    (`Unread.markers`). The characters tokenized
    are the rendered prompt's, the template's markers included (what a refusal is charged: 2,048 empty messages
    have no content but are 57 KB rendered), and its prefix's where that was counted first."""
    applied: tuple[str, ...] = ()
    if input_cap is not None:
        keep = _trim(counter, messages, input_cap, tools, owner, user, markers)
        if len(keep) < len(messages):
            applied = (f"cap_input_tokens({input_cap},dropped={len(messages) - len(keep)})",)
            originals = [originals[i] for i in keep]
            messages = [messages[i] for i in keep]
    limit = tier.context_limit
    chars = sum(len(m["content"]) for m in messages) + len(tools)
    if chars > limit * counter.max_token_chars:
        raise _too_long(tier, f"{chars} characters, more than {limit} tokens can hold", 0)  # read no further
    text, count = counter.rendered(with_preamble(messages, tools), specials_as_text=specials_as_text, markers=markers)
    prefix_chars = limit * PREFIX_CHARS_PER_TOKEN
    prefixed = len(text) > prefix_chars
    if prefixed and count(text[:prefix_chars]) > limit + PREFIX_MARGIN_TOKENS:
        raise _too_long(tier, f"more than {limit} tokens in its first {prefix_chars} characters", prefix_chars)
    return originals, applied, count(text), len(text) + (prefix_chars if prefixed else 0)


def _trim(counter: TokenCounter, messages: list[dict[str, Any]], cap: int, tools: str = "",
          owner: Hashable = None, user: Hashable = None, markers: MarkerEscape | None = None) -> list[int]:
    """Indexes of the messages kept when the oldest turns (never a system message, never the last message)
    are dropped until the prompt has at most `cap` tokens, or nothing more may be dropped."""
    droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
    if not droppable:
        return list(range(len(messages)))
    dropping = set(droppable)
    fixed = [i for i in range(len(messages)) if i not in dropping]
    budget = cap * counter.max_token_chars  # characters that `cap` tokens can cover at most
    room = budget - sum(len(messages[i]["content"]) for i in fixed) - len(tools)
    candidates: list[int] = []  # droppable turns that might fit, newest first
    for i in reversed(droppable):
        room -= len(messages[i]["content"])
        if room < 0:
            break
        candidates.append(i)
    candidates.reverse()  # oldest first
    counts = counter.content_tokens([messages[i]["content"] for i in candidates], markers)
    estimate = dict(zip(candidates, (n + counter.message_overhead(messages[i]["role"])
                                     for i, n in zip(candidates, counts, strict=True)), strict=True))
    kept = sorted(fixed + candidates)
    total = counter.prompt_tokens(with_preamble([messages[i] for i in kept], tools), owner, user, markers=markers)
    dropped, recounts = 0, 0
    while total > cap and dropped < len(candidates):
        # drop by the estimate, then check exactly; an estimate that was short drops one turn more (and
        # after MAX_RECOUNTS exact checks, every candidate left: the bound keeps this linear for any template)
        while total > cap and dropped < len(candidates):
            total -= estimate[candidates[dropped]]
            dropped += 1
        recounts += 1
        if recounts >= MAX_RECOUNTS:
            dropped = len(candidates)
        kept = sorted(fixed + candidates[dropped:])
        total = counter.prompt_tokens(with_preamble([messages[i] for i in kept], tools), owner, user, markers=markers)
    return kept


class ContextTooLong(InvalidRequest):
    """`context_length_exceeded`, with the characters tokenized to know it (about): what the refusal cost, which the
    gate charges to the tenant (gateway/pipeline/gate.py's `refused_size`)."""

    def __init__(self, message: str, *, tokenized_chars: int) -> None:
        super().__init__(message, param="messages", code="context_length_exceeded")
        self.tokenized_chars = tokenized_chars


def _too_long(tier: TierSpec, what: str, tokenized_chars: int) -> ContextTooLong:
    return ContextTooLong(f"tier {tier.name!r} has a context of {tier.context_limit} tokens; the request needs "
                          f"{what}", tokenized_chars=tokenized_chars)
