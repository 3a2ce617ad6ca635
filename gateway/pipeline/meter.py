"""Account: what one attempt has used so far, read from the tier's stream chunks, and the `Outcome` it ends in.

The meter is the one mutable thing of an attempt and belongs to it alone: the tier's chunks go in, one
frozen `Outcome` comes out for the settle stage. Usage comes from the chunks' `usage` (our engine and vLLM
send it in every chunk when asked for `continuous_usage_stats`, so a cancelled stream is still countable)
and the engine's busy time from `x_tiergate.busy_s`. A server that reports no usage in its stream at all (some
OpenAI-compatible servers ignore `stream_options`: llama-cpp-python's) is billed on our own count: the prompt
tokens the gateway counted to reserve, and one token per streamed content chunk, as such servers stream them.

Where a check reads the engine's signals (the cascade's, `Reading`), the meter gathers them as the tokens come:
over the whole answer and, for a look-ahead, over its first tokens; for a stop at a divergence risk
(tiers/divergence.py), the risk token by token (O(1) each), and the early judgement is due (`past_lookahead`) at the
first token where it passes the stop's threshold, not at a fixed token.

Who pays the counted prompt when the tier reported no usage:
- the tier answered (any chunk came): billed, whatever the status;
- the client left (`cancelled`) once the request was written to the tier's connection (`upstream_started`, told by
  the tier client as it writes): billed, chunk or not. The tier may have run the prefill, and a remote tier (or any
  text completion) sends nothing before its first token: a client leaving just before it would otherwise get a
  prompt's prefill, of any length, for free. A client that leaves while the gateway is still connecting (up to
  the connect timeout, 5 s) leaves before it: nothing reached the tier, not billed;
- the call failed (`error`: unreachable, timed out, refused) before any chunk: not billed. Either nothing ran or
  the failure is the tier's, that is our side's, not the client's.
A client that leaves while it waits for a dispatch slot leaves before `upstream_started`: not billed.

A tier's usage is its word, and it is checked before it is billed (`reported_tokens`): a field that is not a count
(negative, a bool, a float with a fraction, a string) or is absurd is taken as unreported, and that field is billed on
our own count as above. The output is billed at most the output cap the gateway sent as `max_tokens` (the reservation
covers no more), whatever the tier says or streams; a prompt reported at more than `PROMPT_SLACK` times the counted
prompt plus `PROMPT_MARGIN` tokens (a chat template, a tokenizer's version), or at 0 (no prompt is empty), is taken as
unreported too, and the counted prompt is billed. A prompt reported below the counted one is believed: a remote tier's
model may have another tokenizer than the one counting (a remote tier's `tokenizer` is an estimate), which can need
several times fewer tokens for the same text, and billing our count over its word would overcharge the tenant. The
output is billed at least one token per content chunk streamed, whatever the tier reports: each carried at least one
new token, and a server that reports zeros (some fill `usage` with them when they do not count) or less gave its
answers away. The engine's busy time (what the row's compute cost is priced on) is believed only as a
duration from 0 up to the request's time on the tier (`BUSY_LEEWAY_S` more): a negative one made the row's compute
cost negative (and the cost metric's counter refuse it), a huge one made one row's cost swamp a day's report; an
unbelievable one is priced on the wall time instead.

What the tenant is sent is bounded the same way (`overran`): a tier that streams past the `max_tokens` it was sent
(more chunks of text than the cap, each a token at least; more characters than MAX_TOKEN_CHARS a token; more
log-probability entries than tokens) has its answer end at the chunk before, as an answer cut at its cap
(`finish_reason` "length"); the rest is never relayed, kept or billed. Before, it was all relayed, and all held in
memory (the answer's text, a JSON answer's body) for as long as the tier kept streaming. Only the one choice asked
for (index 0: a request has `n` 1) is read; another is not the tenant's answer. A finish reason that is not a short
token (`_FINISH_REASON`) is none. A chunk of tool-call deltas alone is not counted as a token: an engine may send
several for one token (ours closes a call's arguments and opens the next in one, engine/tool_calls.py, and sends a
free answer's calls at its end), so they are bounded by their characters, and their number by the client's bound on
a stream's events (tiers/client.py `CHUNKS_PER_TOKEN`). Nor is the answer's end that a server held back (the last
text, a stop string's partial match it kept) and sends with its finish reason after its last token's chunk: at the
cap, the one chunk that carries the finish reason is the end of what was paid for, not a token past it, and is
relayed (`_held_back_end`); text after it is past the cap. Before, that end was cut, and the answer ended "length".

The answer's whole text (`Outcome.text`) is kept only where something reads it once the answer ends (`keep_text`:
the cache's store, an Idempotency-Key's stored answer, the cascade's check, a rollout's shadow; handle.py says which).
Otherwise only its counts are (what the bill and the cap need): a JSON answer's body is the route's own, built from
the deltas, and a stream's text is the client's once relayed. Kept, a long stream's pieces held about 60 bytes a
chunk for the request's life (2 MB for 32k tokens), then as much again joined.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from gateway.pipeline.tool_call_pieces import ToolCallPieces
from tiers.cascade import AnswerSignals, sum_logprobs
from tiers.divergence import DivergenceRisk, DivergenceStop


@dataclass(frozen=True)
class Reading:
    """What a check of the answer reads (the cascade's): token log-probabilities with `top_logprobs` alternatives
    each, and, with `lookahead`, the signals of the first that many tokens apart; with `stop` (no `lookahead`), the
    divergence risk token by token."""

    top_logprobs: int = 0
    lookahead: int | None = None
    stop: DivergenceStop | None = None


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended and what it used."""

    status: str  # ok | error | cancelled
    http_status: int
    error_code: str | None
    input_tokens: int
    output_tokens: int
    finish_reason: str | None
    text: str  # the answer as far as it went; empty where nothing was to read it (`Meter.keep_text`)
    ttft_s: float | None  # from arrival to the first content
    upstream_s: float | None  # time spent on the tier (None: no tier was called)
    busy_s: float | None  # engine compute time the tier reported for it
    mean_logprob: float | None  # mean token log-probability, where they were asked for
    tool_calls: tuple[dict[str, Any], ...] = ()  # the answer's tool calls, whole (OpenAI's message.tool_calls)
    signals: AnswerSignals | None = None  # the engine's signals of the whole answer, where a `Reading` asked


log = logging.getLogger(__name__)

MAX_REPORTED_TOKENS = 100_000_000  # more than any context holds: a count past it is absurd, not a count
PROMPT_SLACK = 2  # a reported prompt over PROMPT_SLACK * counted + PROMPT_MARGIN is not the prompt we sent
PROMPT_MARGIN = 1024
# the most characters (text and tool calls' names and arguments) an answer may bring a token of its cap: a token of the
# longest vocabularies' is tens of characters (a run of spaces), an answer's average is about four
MAX_TOKEN_CHARS = 1024
BUSY_LEEWAY_S = 1.0  # an engine's busy time may pass our time on the tier by this much (its clock, its rounding)
# a tier's finish reason is kept only as a short token (OpenAI's, vLLM's "abort"): it reaches the tenant, the ledger
# row, the cache and the idempotency store, and an upstream's other text is not trusted there (gateway/errors.py's
# `_upstream_code`); one that is not is no finish reason (null)
_FINISH_REASON = re.compile(r"[a-z0-9_]{1,40}")


def reported_tokens(value: Any) -> int | None:
    """A tier's reported token count, or None where it is not a plausible one (unreported): an int (not a bool) or
    an integral float, from 0 to `MAX_REPORTED_TOKENS`."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= MAX_REPORTED_TOKENS:
        return None
    return value


def reported_seconds(value: Any) -> float | None:
    """A tier's reported busy time, or None where it is not a duration: a finite number (not a bool) from 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _plausible_prompt(reported: int, counted: int) -> bool:
    """A reported prompt the counted one can be (another tokenizer's count, a chat template's tokens); any count
    below ours is (the module's docstring says why)."""
    return reported <= PROMPT_SLACK * counted + PROMPT_MARGIN


class Meter:
    def __init__(self, t0: float, *, keep_logprobs: bool = False, counted_input: int = 0,
                 reading: Reading | None = None, output_cap: int | None = None, keep_text: bool = True) -> None:
        """`counted_input`: the prompt's tokens as the gateway counted them, billed if the tier reports none (or
        none believable). `output_cap`: the `max_tokens` the gateway sent the tier, the most output billed (None:
        no cap known). `keep_text`: the answer's text is kept for the outcome (False: its `text` is empty; it may
        be set until the first chunk is added)."""
        self.t0 = t0
        self.counted_input = counted_input
        self.output_cap = output_cap
        self.usage_reported = False
        self.input_reported = False  # a believable prompt count came (`reported_tokens`)
        self.output_reported = False  # ... a believable output count
        self.distrusted: set[str] = set()  # usage fields the tier sent that were not believed
        self.content_chunks = 0
        self.text_chunks = 0  # chunks with text (`overran`: each a token at least; tool-call deltas may not be)
        self.output_chars = 0  # characters of content and tool calls read (`overran`)
        self.logprob_entries = 0
        self.overran = False  # the tier streamed past the output cap: the answer ends before that chunk
        self.chunks = 0  # chunks the tier sent: it answered
        self.keep_logprobs = keep_logprobs  # the client asked for them: they are part of its answer
        self.logprobs: list[dict[str, Any]] = []
        self.input_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.busy_s: float | None = None
        self.ttft_s: float | None = None
        self.upstream_t0: float | None = None
        self.upstream_s: float | None = None
        self.keep_text = keep_text
        self._parts: list[str] = []  # the answer's text, where it is kept (`keep_text`)
        self._logprob_sum = 0.0
        self._logprob_n = 0
        self._calls = ToolCallPieces()
        self.lookahead = reading.lookahead if reading is not None else None
        self.signals = AnswerSignals() if reading is not None else None
        # what the early judgement reads (handle.py hands it to the cascade's `look`): the signals of the first
        # `lookahead` tokens, or the divergence risk so far
        self.risk = DivergenceRisk(reading.stop) if reading is not None and reading.stop is not None else None
        self.first: AnswerSignals | DivergenceRisk | None = (AnswerSignals() if self.lookahead is not None
                                                             else self.risk)
        self.cut = False  # the gateway stopped reading the answer (the cascade judged it early)

    def upstream_started(self) -> None:
        """The request reached the tier's connection; the first time counts (a retry on a new connection does not
        move it)."""
        if self.upstream_t0 is None:
            self.upstream_t0 = time.perf_counter()

    def upstream_ended(self) -> None:
        if self.upstream_t0 is not None and self.upstream_s is None:
            self.upstream_s = time.perf_counter() - self.upstream_t0

    def add(self, chunk: dict[str, Any]) -> tuple[str, list[dict[str, Any]] | None, bool, list[dict[str, Any]]]:
        """Count one upstream chunk; returns its content, its logprobs entries, whether it carried a choice, and its
        `delta.tool_calls` entries (as the tier streamed them; the whole calls are kept for the outcome)."""
        self.chunks += 1
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage_reported = True
            self._read_usage(usage)
        ext = chunk.get("x_tiergate")
        if isinstance(ext, dict) and (busy := reported_seconds(ext.get("busy_s"))) is not None:
            self.busy_s = busy
        content, logprobs, has_choice, calls = "", None, False, []
        picked = []  # the choice asked for (index 0: `n` is 1), each with what it brings, read once
        chars = entries = 0
        text = False
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index") not in (0, None):
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            piece = delta.get("content")
            if isinstance(piece, str) and piece:
                chars += len(piece)
                text = True
            if (tool_calls := delta.get("tool_calls")) and isinstance(tool_calls, list):
                chars += len(repr(tool_calls))  # bounded by the line it came in (tiers.client.MAX_LINE_BYTES)
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                entries += len(lp["content"])
            else:
                lp = None
            picked.append((choice, delta, piece, lp))
        if picked and (cap := self.output_cap) is not None:  # the cap's check, inline: it runs for every chunk
            if (text and self.text_chunks >= cap and not self._held_back_end(picked, cap)) \
                    or self.output_chars + chars > cap * MAX_TOKEN_CHARS \
                    or self.logprob_entries + entries > cap:
                self._overrun(cap)
                return content, logprobs, has_choice, calls
            self.output_chars += chars
            self.logprob_entries += entries
        for choice, delta, piece, lp in picked:
            calls += self._tool_calls(delta)
            if isinstance(piece, str) and piece:
                content += piece
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.t0
            if reason := choice.get("finish_reason"):
                self.finish_reason = reason if isinstance(reason, str) and _FINISH_REASON.fullmatch(reason) else None
            if lp is not None:
                logprobs = (logprobs or []) + lp["content"]
                if self.keep_logprobs:
                    self.logprobs.extend(lp["content"])
                total, n = sum_logprobs([lp])
                self._logprob_sum += total
                self._logprob_n += n
                if self.signals is not None:
                    self.signals.add_openai(lp)
                if self.lookahead is not None and isinstance(self.first, AnswerSignals):
                    self.first.add_openai(lp, limit=self.lookahead)
                elif self.risk is not None:
                    self.risk.add_openai(lp)
            has_choice = has_choice or bool(piece) or bool(choice.get("finish_reason"))
        if content:
            if self.keep_text:
                self._parts.append(content)
            self.text_chunks += 1
        if content or calls:
            self.content_chunks += 1
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.t0
        return content, logprobs, has_choice or bool(calls), calls

    def _held_back_end(self, picked: list[tuple[Any, ...]], cap: int) -> bool:
        """The chunk of text right after the cap's last token chunk carries the finish reason: the end of the answer
        a server held back and sends with its finish (the module's docstring), no new token. Once: any text after it
        is past the cap."""
        return self.text_chunks == cap and any(choice.get("finish_reason") for choice, *_ in picked)

    def _overrun(self, cap: int) -> None:
        """A chunk would take the answer past the output cap (the module's docstring): the answer ends before it."""
        if not self.overran:
            log.warning("tier streamed past the output cap %d (%d content chunks, %d characters, %d log-probability "
                        "entries so far): its answer ends there", cap, self.content_chunks, self.output_chars,
                        self.logprob_entries)
        self.overran = True

    def _read_usage(self, usage: dict[str, Any]) -> None:
        """The chunk's usage, each field as far as it is believable; a field that is not keeps what came before
        (or, if nothing did, is billed on our count, `outcome`). A zero keeps an earlier count, as a field left out
        does."""
        prompt = reported_tokens(usage.get("prompt_tokens"))
        if prompt == 0 and self.counted_input:  # no prompt is empty: a zero is a count left out, as it is below
            prompt = None
        elif prompt is not None and self.counted_input and not _plausible_prompt(prompt, self.counted_input):
            self._distrust("prompt_tokens", prompt)
            prompt = None
        if prompt is not None:
            self.input_reported = True
            self.input_tokens = prompt or self.input_tokens
        elif usage.get("prompt_tokens") is not None and reported_tokens(usage["prompt_tokens"]) is None:
            self._distrust("prompt_tokens", usage["prompt_tokens"])
        output = reported_tokens(usage.get("completion_tokens"))
        if output is not None:
            if self.output_cap is not None and output > self.output_cap:
                self._distrust("completion_tokens", output)
                output = self.output_cap
            self.output_reported = True
            self.output_tokens = output or self.output_tokens
        elif usage.get("completion_tokens") is not None:
            self._distrust("completion_tokens", usage["completion_tokens"])

    def _distrust(self, field: str, value: Any) -> None:
        if field not in self.distrusted:  # once an attempt: a tier reports in every chunk
            self.distrusted.add(field)
            log.warning("tier reported usage %s=%.40r, not believed (counted prompt %d, output cap %s)", field, value,
                        self.counted_input, self.output_cap)

    def _tool_calls(self, delta: Any) -> list[dict[str, Any]]:
        """The delta's `tool_calls` entries, each joined into the call of its index."""
        entries = delta.get("tool_calls") if isinstance(delta, dict) else None
        if not isinstance(entries, list):
            return []
        kept = [e for e in entries if isinstance(e, dict) and isinstance(e.get("index", 0), int)]
        for entry in kept:
            self._calls.add(entry)
        return kept

    @property
    def past_lookahead(self) -> bool:
        """The early judgement is due: the answer has a token beyond the look-ahead (its first tokens are all in,
        and it did not stop there), or its divergence risk passed the stop's threshold."""
        if self.risk is not None:
            return self.risk.passed
        return self.lookahead is not None and self.signals is not None and self.signals.num_tokens > self.lookahead

    def stop_reading(self, finish_reason: str = "cascaded") -> None:
        """The gateway stops reading the answer before its end (billed for what came): the cascade judged it early,
        or the tier went past its cap (`overran`, "length")."""
        self.cut = True
        self.finish_reason = finish_reason

    def add_cached(self, text: str, usage: dict[str, Any]) -> None:
        """A cached answer, no tier: `usage` is this request's (`Hit.request_usage`: its own prompt tokens, the
        stored answer's completion tokens and finish reason)."""
        self._parts.append(text)
        self.input_tokens = int(usage.get("prompt_tokens", 0))
        self.output_tokens = int(usage.get("completion_tokens", 0))
        self.finish_reason = usage.get("finish_reason") or "stop"
        self.usage_reported = self.input_reported = self.output_reported = True
        self.ttft_s = time.perf_counter() - self.t0

    def outcome(self, status: str, http_status: int, error_code: str | None = None, *,
                output_delivered: bool = True) -> Outcome:
        """How the attempt ended. With `output_delivered` False (an error the client got instead of a JSON
        answer) the output is not billed: the client pays for the prompt it sent, not for text it never saw."""
        self.upstream_ended()
        sent = self.upstream_t0 is not None  # the request went to the tier, which may have run its prefill
        if self.chunks or (status == "cancelled" and sent):  # billable: what the tier did not count, we count
            if not self.input_reported:
                self.input_tokens = self.counted_input
            if not self.output_reported or self.output_tokens < self.content_chunks:  # a chunk is a token at least
                self.output_tokens = self.content_chunks
        if self.output_cap is not None:  # the most the tier was asked for, and the reservation covers
            self.output_tokens = min(self.output_tokens, self.output_cap)
        busy = self.busy_s
        if busy is not None and self.upstream_s is not None and busy > self.upstream_s + BUSY_LEEWAY_S:
            self._distrust("busy_s", busy)
            busy = None  # the compute cost is the request's time on the tier (`wall`), not an engine's absurd word
        mean = self._logprob_sum / self._logprob_n if self._logprob_n else None
        output = self.output_tokens if output_delivered else 0
        return Outcome(status, http_status, error_code, self.input_tokens, output, self.finish_reason,
                       "".join(self._parts), self.ttft_s, self.upstream_s, busy, mean,
                       tuple(self._calls.calls()), self.signals)
