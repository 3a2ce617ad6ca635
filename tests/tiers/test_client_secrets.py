"""The tier's API key never reaches a tier error's text. aiohttp's ClientResponseError (an answer whose head cannot
be read, a redirect loop) holds the request it was about, headers and all, in its repr; the client words it as
UpstreamUnreachable, whose text the gateway logs and shows operators as a replica's reason (/health, the
dashboard). The server here is a raw socket server, so the test decides every byte of the answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tiers.client import TierClient
from tiers.errors import UpstreamUnreachable

SECRET = "sk-upstream-secret-0123456789abcdef"


async def _serve(answer: bytes) -> tuple[asyncio.Server, str]:
    """A server that reads a request's head (and body, if any) and sends `answer`, whatever was asked."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


# a status line aiohttp cannot read, and a redirect to itself (each a ClientResponseError, holding the request)
BAD_HEAD = b"HTTP/1.1 abc nonsense\r\nconnection: close\r\n\r\n"
REDIRECT = (b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /v1/chat/completions\r\ncontent-length: 0\r\n"
            b"connection: close\r\n\r\n")


@pytest.fixture(params=[BAD_HEAD, REDIRECT], ids=["bad_head", "redirect_loop"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    server, url = await _serve(request.param)
    async with server:
        yield url


async def test_a_failed_stream_names_no_api_key(upstream: str) -> None:
    client = TierClient()
    try:
        with pytest.raises(UpstreamUnreachable) as err:
            async for _ in client.stream_chat(upstream, {"model": "m", "messages": []}, api_key=SECRET):
                pass
    finally:
        await client.aclose()
    text = str(err.value)
    assert upstream in text and ("ClientResponseError" in text or "TooManyRedirects" in text)
    assert SECRET not in text and "authorization" not in text.lower()
    assert "\n" not in text  # aiohttp words a bad head over several lines: one line here, as a log line takes it


async def test_a_failed_health_read_names_no_api_key(upstream: str) -> None:
    client = TierClient()
    try:
        with pytest.raises(UpstreamUnreachable) as err:
            await client.get_json(upstream + "/health", api_key=SECRET)
    finally:
        await client.aclose()
    text = str(err.value)
    assert SECRET not in text and "authorization" not in text.lower() and "\n" not in text
