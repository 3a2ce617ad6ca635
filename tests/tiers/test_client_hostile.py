"""A hostile or broken upstream, byte by byte: whatever it answers, the tier client raises one of `tiers.errors` (which
the gateway maps to an OpenAI-shaped error and the breaker counts), reads a bounded amount, and returns in bounded
time. The server is a raw socket server, so the test decides every byte, the status line and the headers included."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import tiers.client as client_module
from tiers.cascade import AnswerSignals
from tiers.client import TierClient, as_chat_chunk
from tiers.errors import UpstreamProtocolError, UpstreamRejected, UpstreamTimedOut

Writer = Callable[[asyncio.StreamWriter], Any]
DEEP = b"[" * 100_000 + b"]" * 100_000  # nested past any parser's recursion limit
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def head(status: int, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\nconnection: close\r\n\r\n" % (status, content_type)


def once(data: bytes) -> Writer:
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
    return write


def endless(start: bytes, piece: bytes) -> Writer:
    """`start`, then `piece` again and again until the client goes."""
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(start)
        while True:
            writer.write(piece)
            await writer.drain()
    return write


@contextlib.asynccontextmanager
async def upstream(write: Writer) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            request_head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in request_head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            await write(writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def stream(write: Writer, body: dict[str, Any] | None = None, **client: Any) -> list[dict[str, Any]]:
    """The chunks the client yields, in at most 10 s (an unbounded read fails the test, not hangs it)."""
    async with upstream(write) as url:
        tier = TierClient(**client)
        try:
            async def read() -> list[dict[str, Any]]:
                return [c async for c in tier.stream_chat(url, body or {"model": "m", "messages": []})]
            return await asyncio.wait_for(read(), 10)
        finally:
            await tier.aclose()


async def get_json(write: Writer) -> dict[str, Any]:
    async with upstream(write) as url:
        tier = TierClient()
        try:
            return await asyncio.wait_for(tier.get_json(url, timeout_s=8), 10)
        finally:
            await tier.aclose()


async def test_a_chunk_nested_past_the_decoders_depth_is_a_protocol_error() -> None:
    # was a RecursionError: no TierError, so the tenant read the gateway's own 500 and no breaker counted it
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await stream(once(SSE_HEAD + b"data: " + DEEP + b"\n\ndata: [DONE]\n\n"))
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await stream(once(SSE_HEAD + b'data: {"choices": ' + DEEP + b"}\n\ndata: [DONE]\n\n"))


async def test_an_error_body_nested_past_the_parsers_depth_is_the_upstreams_error_in_its_words() -> None:
    with pytest.raises(UpstreamRejected) as err:
        await stream(once(head(500) + DEEP))
    assert err.value.status == 500 and err.value.replica_failed
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await get_json(once(head(200) + DEEP))


async def test_an_error_body_that_never_ends_is_read_only_to_its_bound() -> None:
    # was read whole: an endless (or many-MB) error answer held the request and grew the gateway's memory
    with pytest.raises(UpstreamRejected) as err:
        await stream(endless(head(503, b"text/plain"), b"e" * 65536))
    assert err.value.status == 503 and len(err.value.message) <= client_module.MAX_ERROR_BYTES
    with pytest.raises(UpstreamRejected):
        await get_json(endless(head(500, b"text/plain"), b"e" * 65536))


async def test_a_json_answer_that_never_ends_is_a_protocol_error() -> None:
    with pytest.raises(UpstreamProtocolError, match="longer than"):
        await get_json(endless(head(200) + b'{"data": ["', b"m" * 65536))
    assert await get_json(once(head(200) + b'{"object": "list", "data": []}')) == {"object": "list", "data": []}


def paced(pieces: list[tuple[bytes, float]]) -> Writer:
    """Each piece, then a pause of its seconds: the upstream's pace is what these tests are about."""
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for piece, pause in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
    return write


CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


async def test_keep_alive_comments_without_data_time_out() -> None:
    # was never: each comment reset the read timeout, so a stream of only keep-alives held its request for ever
    with pytest.raises(UpstreamTimedOut, match=r"no data in 0\.5s"):
        await stream(paced([(CHUNK, 0)] + [(b": keep-alive\n\n", 0.05)] * 1000), read_timeout_s=0.5)
    # the bound is on the time between data events, not on the answer's: keep-alives between them are fine
    pinged = [(CHUNK, 0)] + [(b": ping\r\n\r\n", 0.05), (CHUNK, 0)] * 40 + [(b"data: [DONE]\n\n", 0)]
    chunks = await stream(paced(pinged), read_timeout_s=0.5)
    assert len(chunks) == 41


@pytest.mark.parametrize("filler", [b"\n", b"\r\n", b": keep-alive\n", b"event: message\n", b"id: 1\n"])
async def test_lines_without_data_sent_as_fast_as_they_go_are_a_protocol_error(filler: bytes) -> None:
    # were parsed on the event loop until the read timeout (600 s by default), as fast as the upstream sent them
    with pytest.raises(UpstreamProtocolError, match="bytes of the stream without data"):
        await stream(endless(SSE_HEAD + CHUNK, filler * 4096))


@pytest.mark.parametrize("event", [b'data: {"choices": []}\n\n', b'data: {"choices": [{"index": 0, "delta": {}}]}\n\n',
                                   CHUNK])
async def test_a_stream_past_what_max_tokens_allows_is_a_protocol_error(event: bytes) -> None:
    # was never ending: an upstream sending events with nothing (or anything) in them held its request for ever
    with pytest.raises(UpstreamProtocolError, match="more events than max_tokens=4 allows"):
        await stream(endless(SSE_HEAD, event), {"model": "m", "messages": [], "max_tokens": 4})
    allowed = client_module.CHUNKS_PER_TOKEN * 4 + client_module.CHUNK_SLACK
    chunks = await stream(once(SSE_HEAD + event * allowed + b"data: [DONE]\n\n"),
                          {"model": "m", "messages": [], "max_tokens": 4})
    assert len(chunks) == allowed


@pytest.mark.parametrize("data", [b'{"message": "overloaded"}', CHUNK[6:-2], b"overloaded", b'"overloaded"'])
async def test_the_data_of_an_event_named_error_is_the_upstreams_error(data: bytes) -> None:
    # was read as a chunk: content relayed, or an empty answer billed for its prompt
    for eol in (b"\n", b"\r\n"):
        with pytest.raises(UpstreamRejected) as err:
            await stream(once(SSE_HEAD + CHUNK + b"event: error" + eol + b"data:" + data + eol + eol
                              + b"data: [DONE]" + eol + eol))
        assert err.value.status == 500 and err.value.replica_failed and err.value.message
    # the name is the event's own: the next event is data again
    chunks = await stream(once(SSE_HEAD + b"event: error\n: no data\n\nevent: message\n" + CHUNK + b"data: [DONE]\n\n"))
    assert len(chunks) == 1


@pytest.mark.parametrize("choices", [b"5", b"true", b'"abc"', b'{"0": {}}'])
async def test_choices_that_are_not_a_list_are_a_protocol_error(choices: bytes) -> None:
    # were read as they came: a number raised TypeError where the gateway iterates them (the tenant read the
    # gateway's own 500, no breaker counted it), a string or an object was iterated as one
    with pytest.raises(UpstreamProtocolError, match="choices are not a list"):
        await stream(once(SSE_HEAD + b'data: {"choices": ' + choices + b"}\n\ndata: [DONE]\n\n"))
    assert await stream(once(SSE_HEAD + b'data: {"choices": null}\n\ndata:{"usage": {}}\r\n\r\ndata: [DONE]\n\n')) \
        == [{"choices": None}, {"usage": {}}]  # null, or none, is no choice; `data:` needs no space


@pytest.mark.parametrize("bad", [5, "abc", {"a": 1}, None])
def test_log_probabilities_of_the_wrong_shape_are_none(bad: object) -> None:
    # a number raised TypeError (the gateway's own 500 for the tenant, no breaker counting it)
    legacy = {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": bad}}]}
    assert "logprobs" not in as_chat_chunk(legacy)["choices"][0]
    signals = AnswerSignals()
    signals.add_openai({"content": [{"token": "a", "logprob": -0.5, "top_logprobs": bad}]})
    assert signals.num_tokens == 1 and not signals.has_alternatives


async def test_an_error_event_longer_than_the_error_bound_is_a_protocol_error_not_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # was parsed whole (a line may hold up to MAX_LINE_BYTES, 1 MiB) and decoded whole again for a message of 500
    # characters: a hostile upstream had the event loop read a megabyte for each error it sent
    parsed: list[int] = []
    real = client_module._json_or_text
    monkeypatch.setattr(client_module, "_json_or_text", lambda data: parsed.append(len(data)) or real(data))
    bound = client_module.MAX_ERROR_BYTES
    for data in (b'{"message": "' + b"x" * (client_module.MAX_LINE_BYTES - 1000) + b'"}',
                 b"\xc3\xa9" * (bound // 2 + 1), b'{"error": {"message": "' + b"x" * bound + b'"}}'):
        with pytest.raises(UpstreamProtocolError, match=f"longer than {bound} bytes") as err:
            await stream(once(SSE_HEAD + CHUNK + b"event: error\ndata: " + data + b"\n\ndata: [DONE]\n\n"))
        assert len(str(err.value)) < 200
    assert parsed == []
    # up to the bound it is the upstream's error, its message cut short as any error's
    for data, message in ((b'{"message": "' + b"x" * (bound - 20) + b'"}', "x" * 500),
                          (b"\xc3\xa9" * (bound // 2), "\xe9" * 500)):
        with pytest.raises(UpstreamRejected) as rejected:
            await stream(once(SSE_HEAD + CHUNK + b"event: error\ndata: " + data + b"\n\ndata: [DONE]\n\n"))
        assert rejected.value.status == 500 and rejected.value.message == message
    assert all(size <= bound for size in parsed) and len(parsed) == 2
