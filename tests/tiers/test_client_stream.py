"""How the tier client reads an event stream off the wire: whatever way the bytes are cut into reads (a byte at a
time, several events in one read, CRLF lines, comments, an unfinished last line), the same chunks come out; a
stream without `[DONE]`, a chunk that is not JSON and a line over the limit are protocol errors. The server is a
raw socket server, so the test decides every byte and every pause."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

import tiers.client as client_module
from tiers.client import TierClient
from tiers.errors import UpstreamProtocolError, UpstreamRejected

Writer = Callable[[asyncio.StreamWriter], Any]


async def _serve(write_body: Writer) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        await write_body(writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _events(n: int, eol: bytes = b"\n") -> bytes:
    out = b": a comment" + eol + eol + b"event: message" + eol
    for i in range(n):
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": f" t{i} é"}, "finish_reason": None}]}
        out += b"data: " + json.dumps(chunk).encode() + eol + eol
    return out + b"data: [DONE]" + eol + eol


async def _read(write_body: Writer) -> list[dict[str, Any]]:
    server, url = await _serve(write_body)
    client = TierClient()
    try:
        return [c async for c in client.stream_chat(url, {"model": "m", "messages": []})]
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


def _pieces(data: bytes, size: int) -> Writer:
    async def write(writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(data), size):
            writer.write(data[i:i + size])
            await writer.drain()
            await asyncio.sleep(0.0005 if size < 8 else 0.002)  # a read each, most of the time
    return write


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
async def test_the_same_chunks_however_the_bytes_are_cut(size: int, eol: bytes) -> None:
    chunks = await _read(_pieces(_events(12, eol), size))
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [f" t{i} é" for i in range(12)]


async def test_an_unfinished_last_line_is_read_and_what_follows_done_is_not() -> None:
    chunks = await _read(_pieces(_events(2) + b'data: {"late": 1}\n\n', 1 << 20))
    assert len(chunks) == 2
    done_last = b'data: {"choices": []}\n\ndata: [DONE]'  # no newline: the connection closes after it
    assert await _read(_pieces(done_last, 5)) == [{"choices": []}]


async def test_a_stream_without_done_is_an_error() -> None:
    with pytest.raises(UpstreamProtocolError, match="without \\[DONE\\]"):
        await _read(_pieces(_events(3)[:-len(b"data: [DONE]\n\n")], 10))


async def test_a_chunk_that_is_not_json_is_an_error() -> None:
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await _read(_pieces(b"data: {\"a\": \n\ndata: [DONE]\n\n", 1 << 20))
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await _read(_pieces(b"data: \xff\xfe\n\ndata: [DONE]\n\n", 1 << 20))
    with pytest.raises(UpstreamProtocolError, match="not a JSON object"):
        await _read(_pieces(b"data: [1, 2]\n\ndata: [DONE]\n\n", 1 << 20))


async def test_an_error_event_is_the_upstreams_error() -> None:
    body = b'data: {"error": {"message": "engine stopped", "code": "engine_dead"}}\n\n'
    with pytest.raises(UpstreamRejected) as err:
        await _read(_pieces(body, 3))
    assert err.value.status == 503


@pytest.mark.parametrize("size", [100, 5000])
async def test_a_line_over_the_limit_is_an_error(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(client_module, "MAX_LINE_BYTES", 4096)
    long_line = b"data: " + b"x" * 10_000  # never ends: the reader must stop at the limit, not wait or grow
    with pytest.raises(UpstreamProtocolError, match="longer than 4096"):
        await _read(_pieces(_events(1)[:-len(b"data: [DONE]\n\n")] + long_line, size))
    assert len(await _read(_pieces(_events(1) + long_line, size))) == 1  # after [DONE]: never read
    under = {"choices": [{"delta": {"content": "y" * 3000}}]}
    assert await _read(_pieces(b"data: " + json.dumps(under).encode() + b"\n\ndata: [DONE]\n\n", size)) == [under]
