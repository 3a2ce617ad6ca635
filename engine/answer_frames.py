"""How the engine's server frames a request's outputs as OpenAI's answers: chat (`message`, `delta`, tool calls
shaped by engine/tool_calls.py) or legacy text (`text`), whole or as server-sent events, with the logprobs the
request asked for; and an engine's failure as OpenAI's error shape (a request that failed by its own content, its
response_format, is a 400 no breaker counts: wire.errors.REQUEST_FAULT_CODES). A request `generate` refuses as it
starts (EngineInputError: its response format refused to its tenant after the server's own checks passed, by another
of the tenant's requests failing within the schema meanwhile) is the 400 the server's checks would have given
(`refusal`): a whole answer's status, or, the stream's headers being sent already, the stream's last event; one it
refuses as the engine filled up meanwhile (EngineBusyError) is the 429 the server's own check gives, so too.

A stream's failure after its headers are sent is its last event before `[DONE]`, never a cut connection; a framing
bug aborts the request's generation (slot and KV blocks go back).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Response

from engine.llm_engine import EngineBusyError, EngineDeadError, EngineInputError, RequestOutput
from engine.tool_calls import ToolAnswer
from wire import responses
from wire.errors import REQUEST_FAULT_CODES, STREAM_ERROR_STATUS, error_body

log = logging.getLogger("tiergate.engine")


def engine_error(out: RequestOutput) -> dict[str, Any]:
    if out.error_code in REQUEST_FAULT_CODES:  # the request's own content failed it (its response_format)
        return error_body(out.error or "the request failed", param="response_format", code=out.error_code)
    return error_body(out.error or "the engine failed on this request", "api_error",
                      code=out.error_code or "engine_error")


def error_status(out: RequestOutput) -> int:
    if out.error_code in REQUEST_FAULT_CODES:
        return 400
    return 503 if out.error_code == "engine_dead" else 500


FAILED = error_body("the engine failed on this request", "api_error", code="engine_error")


def refused(exc: EngineInputError) -> dict[str, Any]:
    """The 400's body for a request refused by `exc` (the server's own, engine/server.py, renames some params)."""
    return error_body(str(exc), param=exc.param, code=exc.code)


Refusal = Callable[[EngineInputError], dict[str, Any]]


def with_status(body: dict[str, Any], status: int) -> dict[str, Any]:
    """An error body sent as a stream's event that stands for the answer `status` it would have been before the
    stream (wire.errors.STREAM_ERROR_STATUS): the gateway reads it so (tiers/client.py), the tenant's 400 or a 429."""
    return {"error": {**body["error"], STREAM_ERROR_STATUS: status}}


def busy(exc: EngineBusyError) -> dict[str, Any]:
    """The 429's body: the engine cannot take the request now (engine/llm_engine.py `check_capacity`)."""
    return error_body(str(exc), "rate_limit_error", param=exc.param, code=exc.code)


@functools.cache
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's characters (SmolLM2's and Llama 3's vocabularies) -> the byte each stands for: transformers'
    `bytes_to_unicode` turned round (imported on the first partial character: it costs the import ~0.5 s)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama 2, Mistral)


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The bytes token `token_id` stands for (`text`: it decoded alone). A token that holds part of a character's
    UTF-8 decodes alone to U+FFFD, so its bytes are read from its vocabulary entry (byte-level BPE, or a
    SentencePiece byte token), where that entry spells them; otherwise they are the text's."""
    if "\ufffd" not in text:
        return text.encode()
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    if isinstance(piece, str) and piece:
        if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte[1], 16)])
        alphabet = _byte_level()
        if all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
            if raw.decode("utf-8", "replace") == text:  # the entry is byte-level: it decodes as the token did
                return raw
    return text.encode()


def _logprobs(tokenizer: Any, out: RequestOutput) -> list[dict[str, Any]] | None:
    """OpenAI's `logprobs.content` entries for the tokens of `out`, when the request asked for them; `bytes` are the
    token's own (`token_bytes`), so those of a character split over tokens join into its UTF-8."""
    if out.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token_id, text))}

    return [entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(out.token_ids, out.logprobs, strict=True)]


def _legacy_logprobs(tokenizer: Any, prompt_chars: int) -> Callable[[RequestOutput], dict[str, Any] | None]:
    """The legacy API's `logprobs` for the tokens of each output of one request, in order: `text_offset` counts
    characters of prompt and completion, as OpenAI's did. Each token starts where the one before it ended, counted by
    the tokens' own text, not by the text sent so far: text held back (it may still become a stop string) is sent
    with a later output, and its tokens would all have started where the holding began."""
    offset = prompt_chars  # where the next token starts

    def made_of(out: RequestOutput) -> dict[str, Any] | None:
        nonlocal offset
        if out.logprobs is None:
            return None
        made: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, (logprob, top) in zip(out.token_ids, out.logprobs, strict=True):
            text = tokenizer.decode([token_id])
            made["tokens"].append(text)
            made["token_logprobs"].append(logprob)
            made["top_logprobs"].append({tokenizer.decode([i]): v for i, v in top})
            made["text_offset"].append(offset)
            offset += len(text)
        return made

    return made_of


@dataclass(frozen=True)
class Frames:
    """How an endpoint frames a request's outputs: chat (`message`, `delta`) or legacy text (`text`)."""

    whole: Callable[..., dict[str, Any]]  # the non-streamed answer
    # the stream chunks' fields for the next (text, logprobs); with `always`, at least one chunk
    pieces: Callable[[str, Any, bool], list[dict[str, Any]]]
    end: Callable[[str | None], tuple[list[dict[str, Any]], str | None]]  # chunks due at the end, finish reason
    chunk: Callable[..., dict[str, Any]]
    usage_chunk: Callable[..., dict[str, Any]]
    logprobs: Callable[[RequestOutput], Any]  # each output of the request, in order -> its logprobs or None
    opening: dict[str, Any]  # the first chunk's fields, sent at once (before the prefill: the request is live)
    finish: dict[str, Any]  # the fields of the chunk that carries the finish reason

    def merge(self, so_far: Any, more: Any) -> Any:
        """`so_far` (the log-probabilities of a request's outputs before, or None) with those of its next output, in
        place: a whole answer's are gathered an output at a time, a token each, and joined anew each was quadratic
        in the answer (8,000 tokens of legacy log-probabilities: 0.4 s of the server's event loop). `more` is the
        next output's own (`logprobs`' fresh list or dict), so it may become `so_far`."""
        if more is None:
            return so_far
        if so_far is None:
            return more
        if isinstance(more, list):
            so_far.extend(more)
            return so_far
        for k, v in more.items():
            so_far.setdefault(k, []).extend(v)
        return so_far


def _one_piece(field: str) -> Callable[[str, Any, bool], list[dict[str, Any]]]:
    """A chunk for each piece of text (`delta.content` or `text`); none for an empty one unless `always`."""

    def pieces(text: str, lps: Any, always: bool) -> list[dict[str, Any]]:
        if not (text or lps or always):
            return []
        return [{field: {"content": text} if field == "delta" else text, "logprobs": lps}]

    return pieces


def _no_end(reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
    return [], reason


def _with_tail(pieces: list[dict[str, Any]], tail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last output's chunks, then those due at the answer's end, the end's first text joined to the last output's
    text where both are a chunk's only delta. That text was held back (a possible start of `<tool_call>`, a block that
    made no call: engine/tool_calls.py) from tokens already counted, and a client counts a chunk of text as a token at
    least: in a chunk of its own, an answer ending at max_tokens read as one token past it, and the gateway's meter
    (gateway/pipeline/meter.py) ended the answer before it, without those characters."""
    if pieces and tail:
        last, first = pieces[-1].get("delta"), tail[0].get("delta")
        if isinstance(last, dict) and isinstance(first, dict) and set(last) == set(first) == {"content"} \
                and set(tail[0]) == {"delta"}:
            joined = {**pieces[-1], "delta": {"content": last["content"] + first["content"]}}
            return [*pieces[:-1], joined, *tail[1:]]
    return [*pieces, *tail]


def chat_frames(tokenizer: Any, tools: ToolAnswer | None) -> Frames:
    """Chat's frames; a request that offers tools has its answer shaped into tool calls by `tools`."""
    return Frames(whole=tools.completion if tools else responses.completion,
                   pieces=tools.pieces if tools else _one_piece("delta"), end=tools.end if tools else _no_end,
                   chunk=responses.chunk, usage_chunk=responses.usage_chunk,
                   logprobs=lambda out: _logprobs(tokenizer, out),
                   opening={"delta": {"role": "assistant", "content": ""}}, finish={"delta": {}})


def text_frames(tokenizer: Any, prompt_chars: int) -> Frames:
    return Frames(whole=responses.text_completion, pieces=_one_piece("text"), end=_no_end,
                   chunk=responses.text_chunk, usage_chunk=responses.text_usage_chunk,
                   logprobs=_legacy_logprobs(tokenizer, prompt_chars),
                   opening={"text": ""}, finish={"text": ""})


async def collect(outputs: AsyncIterator[RequestOutput], rid: str, model: str, frames: Frames,
                  refusal: Refusal = refused) -> Response[Any]:
    """The whole answer; a request `generate` refuses as it starts is a 400 (`refusal`: its body)."""
    parts: list[str] = []
    last: RequestOutput | None = None
    logprobs: Any = None
    try:
        async for out in outputs:
            if out.error is not None:
                return Response(engine_error(out), status_code=error_status(out))
            logprobs = frames.merge(logprobs, frames.logprobs(out))
            parts.append(out.text)
            last = out
    except EngineInputError as exc:  # refused as it started (the server's checks passed before): nothing generated
        return Response(refusal(exc), status_code=400)
    except EngineBusyError as exc:  # the engine filled up since the server's own check
        return Response(busy(exc), status_code=429, headers={"retry-after": str(exc.retry_after_s)})
    assert last is not None
    return Response(frames.whole(
        id_=rid, created=int(time.time()), model=model, text="".join(parts), finish_reason=last.finish_reason,
        prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens, logprobs=logprobs,
        x_tiergate={"busy_s": last.busy_s}))


async def sse_events(outputs: AsyncIterator[RequestOutput], rid: str, model: str,
               include_usage: bool, continuous_usage: bool, frames: Frames,
               refusal: Refusal = refused) -> AsyncIterator[bytes]:
    """The answer as server-sent events; a request `generate` refuses as it starts ends the stream with the 400's body
    (`refusal`) as its last event (the opening chunk is sent before the request is: its headers are a 200)."""
    ids = {"id_": rid, "created": int(time.time()), "model": model}

    def events(out: RequestOutput) -> list[bytes]:
        lps = frames.logprobs(out)
        busy = {"x_tiergate": {"busy_s": out.busy_s}}
        if not out.finished:
            if continuous_usage:
                usage = responses.usage(out.num_prompt_tokens, out.num_output_tokens)
                return [responses.sse(frames.chunk(**ids, **piece, usage=usage, **busy))
                        for piece in frames.pieces(out.text, lps, True)]
            return [responses.sse(frames.chunk(**ids, **piece)) for piece in frames.pieces(out.text, lps, False)]
        pieces = frames.pieces(out.text, lps, False)
        tail, reason = frames.end(out.finish_reason)  # after the last piece: a held tool call is parsed whole
        made = [responses.sse(frames.chunk(**ids, **piece)) for piece in _with_tail(pieces, tail)]
        made.append(responses.sse(frames.chunk(**ids, **frames.finish, finish_reason=reason, **busy)))
        if include_usage:
            made.append(responses.sse(frames.usage_chunk(**ids, prompt_tokens=out.num_prompt_tokens,
                                                         completion_tokens=out.num_output_tokens, **busy)))
        return made

    yield responses.sse(frames.chunk(**ids, **frames.opening))
    try:
        async for out in outputs:
            if out.error is not None:  # the headers are sent: the error is the stream's last event
                yield responses.sse(engine_error(out))
                break
            for event in events(out):
                yield event
    except EngineDeadError as exc:  # the loop stopped between the request's check and its start
        yield responses.sse(error_body(str(exc), "api_error", code="engine_dead"))
    except EngineInputError as exc:  # refused as it started (the server's checks passed before): nothing generated
        yield responses.sse(with_status(refusal(exc), 400))
    except EngineBusyError as exc:  # the engine filled up since the server's own check
        yield responses.sse(with_status(busy(exc), 429))
    except Exception:  # framing failed (a bug): the stream ends with an error event, not a cut connection
        log.exception("streaming %s failed", rid)
        await outputs.aclose()  # its generation stops: slot and KV blocks go back
        yield responses.sse(FAILED)
    yield responses.SSE_DONE
