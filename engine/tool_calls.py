"""Tool calls in our engine's chat answers: the grammar that forces a call, and the answer shaped as OpenAI's.

The prompt side is wire/tool_calls.py (the functions rendered into the system message). Here:
- `answer_format`: the response format the sampler enforces. Under tool_choice "required" or a named function it
  is the call schema (wire/tool_calls.py's `call_schema`), compiled by engine/grammar.py like any json_schema;
  otherwise the request's own `response_format`. A constraining response_format with free tool calls ("auto") is
  refused: the grammar would forbid the calls.
- `ToolAnswer`: one request's answer as content and `tool_calls`, whole or streamed as OpenAI streams them (a call's
  first delta carries its index, id, type, name and empty arguments; the next ones its index and pieces of the
  arguments). A constrained answer streams its arguments as the tokens arrive; a free one streams its text until
  a `<tool_call>` opening, and holds the rest until the answer ends, when it is parsed into calls.
  `finish_reason` is "tool_calls" when an answer that ended by itself made calls.
- `parallel_tool_calls: false`: at most one call per answer, whole or streamed, free or constrained. A free answer
  ends at its first call (wire/tool_calls.py's `parse_answer`: what the model wrote after it is dropped, as at
  OpenAI a call ends the turn), and its finish_reason is "tool_calls" even when max_tokens cut the text after the
  call; a constrained answer's grammar allows one call already (`call_schema`), and anything past it is not read.
  A free answer's generation stops as soon as its first call is whole (`one_call`): what the model would write
  after it is dropped anyway, so it is neither made nor billed.

The answer is model output, and the tenant steers it (a model told to echo writes what it is told), so parsing it
holds whatever it says (wire/tool_calls.py): a block whose "name" is a list or an object is text, not a TypeError (a
500 that counted against the replica's breaker), and arguments whose JSON escapes spell a lone surrogate
(`"\\ud800"`) are sent escaped, never as a body that cannot be encoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import EngineInputError
from wire import responses
from wire.chat_request import ChatCompletionRequest
from wire.response_format import JsonSchemaSpec, ResponseFormat
from wire.tool_calls import CLOSE, OPEN, Call, call_schema, new_call_id, parse_answer, parse_constrained, strict_calls
from wire.tools import offered_tools

MAX_CALL_SCHEMA_BYTES = 256 * 1024  # the call schema of every offered function together, as compact JSON
TOOL_FORMAT_NAME = "tool_calls"
# where a constrained call's arguments begin (the grammar writes `{"name": "f", "arguments": …}`, names first)
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:')
_MAX_HEADER_CHARS = 128


def answer_format(req: ChatCompletionRequest) -> ResponseFormat | None:
    """What the sampler must enforce for `req`: a call of one of its tools, or its own response_format.
    EngineInputError naming `tools` when the call schema is too large to compile."""
    schema = call_schema(req)
    if schema is None:
        if offered_tools(req.tools, req.tool_choice) and req.response_format and req.response_format.constrains:
            raise EngineInputError("response_format: this engine cannot constrain the answer's format while the "
                                   "model may freely call tools (tool_choice 'auto'); send tool_choice 'none' or "
                                   "'required', or leave response_format out", param="response_format")
        return req.response_format
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_CALL_SCHEMA_BYTES:
        raise EngineInputError(f"tools: the functions' parameters take {size} bytes together; a required or named "
                               f"tool_choice is enforced for at most {MAX_CALL_SCHEMA_BYTES}", param="tools")
    # each function's parameters passed wire's bounds; the whole is bounded above
    spec = JsonSchemaSpec.model_construct(name=TOOL_FORMAT_NAME, description=None, schema_=schema,
                                          strict=strict_calls(req))
    return ResponseFormat.model_construct(type="json_schema", json_schema=spec)


def tools_param(exc: EngineInputError, req: ChatCompletionRequest) -> EngineInputError:
    """A compile error of the call schema names `tools`, where the tenant wrote it, not response_format."""
    if exc.param == "response_format" and call_schema(req) is not None:
        return EngineInputError(str(exc).replace("response_format:", "tools:", 1), param="tools", code=exc.code)
    return exc


def ends_at_first_call(req: ChatCompletionRequest) -> bool:
    """Whether `req`'s answer ends at its first call: `parallel_tool_calls: false` on a free answer (a constrained
    one's grammar ends after its one call by itself)."""
    return (req.parallel_tool_calls is False and call_schema(req) is None
            and bool(offered_tools(req.tools, req.tool_choice)))


async def one_call(outputs: AsyncIterator[RequestOutput], req: ChatCompletionRequest) -> AsyncIterator[RequestOutput]:
    """`outputs` up to the one whose text makes the answer's first call whole, given as the last ("stop"), and the
    generation aborted there (closing `outputs` aborts the request: its slot and KV blocks go back). The text is
    parsed again only when an output brings a `</tool_call>`, from the first `<tool_call>` on, which is looked for in
    the new text only (looked for in all of it each output, 8,192 outputs of 29 characters cost the event loop
    0.67 s; now 5 ms, what iterating them costs)."""
    names = {t.function.name for t in offered_tools(req.tools, req.tool_choice)}
    text = ""
    at = -1  # where the first `<tool_call>` begins, once it has come
    try:
        async for out in outputs:
            before = len(text)
            text += out.text  # in place: CPython grows a string no one else holds (measured linear)
            if at < 0:  # an opening may straddle the last output and this one
                at = text.find(OPEN, max(0, before - len(OPEN) + 1))
            if not out.finished and out.error is None and at >= 0 \
                    and text.find(CLOSE, max(at, before - len(CLOSE))) >= 0 and parse_answer(
                        text[at:], names, parallel=False)[1]:
                yield replace(out, finished=True, finish_reason="stop")
                return
            yield out
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


class ToolAnswer:
    """One answer of a request that offers tools, as content and tool calls."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.names = {t.function.name for t in offered_tools(req.tools, req.tool_choice)}
        self.constrained = call_schema(req) is not None
        self.parallel = req.parallel_tool_calls is not False  # OpenAI's default: several calls allowed
        self._text: list[str] = []
        self._ids: list[str] = []  # streamed calls' ids, in order
        # free answers: text not yet sent (a possible start of `<tool_call>`), and once a block has begun, the pieces
        # held from it on, joined when the answer ends (added to one string, each copied all held before it: 8,192
        # pieces of 29 characters took 0.13 s, now 1.4 ms)
        self._pending = ""
        self._held: list[str] = []
        self._holding = False
        # constrained answers: where the scan is ("between" calls, in a call's "header", in its "args", "done" after
        # the one call `parallel_tool_calls: false` allows), or "lost" when the text is not the expected shape (the
        # calls are then sent whole at the end)
        self._state = "between"
        self._header = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started = False  # the current call's arguments have begun (whitespace before them is skipped)

    @staticmethod
    def for_request(req: ChatCompletionRequest) -> ToolAnswer | None:
        """The shaper of `req`'s answer, or None when it offers no tools (tool_choice "none" offers none)."""
        return ToolAnswer(req) if offered_tools(req.tools, req.tool_choice) else None

    def whole(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None,
                                                                  str | None]:
        """(content, tool_calls, finish_reason) of the whole answer `text`."""
        if self.constrained:
            calls = parse_constrained(text, self.names, parallel=self.parallel)
            if calls is None:  # cut short: the JSON as far as it went
                return text, None, finish_reason
            return None, [c.openai() for c in calls], _finish(finish_reason, calls)
        content, calls = parse_answer(text, self.names, parallel=self.parallel)
        if not calls:
            return text, None, finish_reason
        return content or None, [c.openai() for c in calls], self._free_finish(finish_reason, calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The stream deltas for the next piece of the answer (none while text is held)."""
        self._text.append(text)
        return self._scan(text) if self.constrained else self._free(text)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas still due when the answer ends, and its finish reason."""
        text = "".join(self._text)
        if self.constrained:
            calls = parse_constrained(text, self.names, parallel=self.parallel)
            if self._state == "lost" and not self._ids:  # nothing streamed yet: the calls whole, or the text
                if calls is None:
                    return [{"content": text}], finish_reason
                return [d for i, c in enumerate(calls) for d in _call_deltas(i, c)], _finish(finish_reason, calls)
            return [], _finish(finish_reason, calls or [])
        if not self._holding:
            return ([{"content": self._pending}] if self._pending else []), finish_reason
        held = "".join(self._held)  # from the first `<tool_call>` on
        content, calls = parse_answer(held, self.names, parallel=self.parallel)
        if not calls:
            return [{"content": held}], finish_reason
        deltas = [{"content": content}] if content else []
        deltas += [d for i, c in enumerate(calls) for d in _call_deltas(i, c)]
        return deltas, self._free_finish(finish_reason, calls)

    def _free_finish(self, reason: str | None, calls: list[Call]) -> str | None:
        """A free answer's finish reason: one that ends at its only call (`parallel_tool_calls: false`) ended there,
        whatever stopped the text after it."""
        if calls and not self.parallel and reason == "length":
            return "tool_calls"
        return _finish(reason, calls)

    def completion(self, *, text: str, finish_reason: str | None, **fields: Any) -> dict[str, Any]:
        """The whole chat completion (wire/responses.py's `completion`) of the answer `text`."""
        content, calls, reason = self.whole(text, finish_reason)
        return responses.completion(text=content, tool_calls=calls, finish_reason=reason, **fields)

    def pieces(self, text: str, logprobs: Any, always: bool) -> list[dict[str, Any]]:
        """The stream chunks' fields for the next piece of text (its log-probabilities on the first); with
        `always`, at least one chunk (an empty delta)."""
        made: list[dict[str, Any]] = [{"delta": d} for d in self.feed(text)]
        if not made and (logprobs or always):
            made = [{"delta": {}}]
        if made:
            made[0]["logprobs"] = logprobs
        return made

    def end(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The stream chunks' fields still due when the answer ends, and its finish reason."""
        deltas, reason = self.finish(finish_reason)
        return [{"delta": d} for d in deltas], reason

    def _free(self, text: str) -> list[dict[str, Any]]:
        if self._holding:
            self._held.append(text)
            return []
        self._pending += text  # what was held back is shorter than `<tool_call>`
        at = self._pending.find(OPEN)
        if at >= 0:
            self._holding = True
            sent, self._held, self._pending = self._pending[:at], [self._pending[at:]], ""
            return [{"content": sent}] if sent else []
        keep = _partial_opening(self._pending)
        sent = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(sent):]
        return [{"content": sent}] if sent else []

    def _scan(self, text: str) -> list[dict[str, Any]]:
        """Follow a constrained answer character by character: a call's first delta when its name is known, then
        its arguments as they come."""
        deltas: list[dict[str, Any]] = []
        args: list[str] = []

        def flush() -> None:
            if args:
                deltas.append(responses.arguments_delta(len(self._ids) - 1, "".join(args)))
                args.clear()

        for ch in text:
            if self._state == "done":  # the one call allowed has closed (`parallel_tool_calls: false`)
                break
            if self._state == "between":
                if ch == "{":
                    self._state, self._header = "header", ch
            elif self._state == "header":
                self._header += ch
                if (m := _HEADER.fullmatch(self._header)) is not None:
                    self._ids.append(new_call_id())
                    deltas += responses.tool_call_deltas(len(self._ids) - 1, self._ids[-1], m.group(1))
                    self._state, self._depth, self._started = "args", 0, False
                elif len(self._header) > _MAX_HEADER_CHARS:
                    self._state = "lost"
            elif self._state == "args":
                if not self._started and ch in " \t\r\n":
                    continue
                self._started = True
                if self._in_string:
                    if self._escaped:
                        self._escaped = False
                    elif ch == "\\":
                        self._escaped = True
                    elif ch == '"':
                        self._in_string = False
                elif ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    if self._depth == 0:  # the brace that closes the call
                        flush()
                        self._state = "between" if self.parallel else "done"
                        continue
                    self._depth -= 1
                args.append(ch)
        flush()
        return deltas


def _finish(reason: str | None, calls: list[Call]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _call_deltas(index: int, call: Call) -> list[dict[str, Any]]:
    return responses.tool_call_deltas(index, new_call_id(), call.name, call.arguments)


def _partial_opening(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>` (held back until the next piece)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
