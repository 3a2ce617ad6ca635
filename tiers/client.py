"""One HTTP client for every tier backend: local engines and remote OpenAI-compatible servers alike.

What crosses this boundary: an OpenAI chat-completions body goes in; parsed stream chunks (dicts) come
out, in order, ending after the upstream's `[DONE]`. aiohttp's errors become `tiers.errors` exceptions
here and nowhere else, and so does an error event inside a stream (`data: {"error": {...}}`, what an
upstream sends when it fails after the headers, or the data of an event named `error`): UpstreamRejected
with that body, never content. Closing the iterator early closes the upstream connection, which tells the
engine to abort the request; a stream read to its end leaves its connection in the pool for the next request.
When an upstream's connection drops mid-stream, aiohttp raises before handing over bytes it had buffered but
not yet delivered, so an answer that dies is billed for the chunks the gateway had read (at an engine's pace,
all but the last).

Why aiohttp: this is the gateway's hot path, and on one core a forwarding app made about 2x the requests
per second with aiohttp's client than with httpx's default transport at 1 connection, and 4-7x at 16-64
(DESIGN.md, "Where the bar stands"; `bench/gateway.py` measures the whole gateway).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

import aiohttp
import msgspec

from tiers.errors import UpstreamProtocolError, UpstreamRejected, UpstreamTimedOut, UpstreamUnreachable, quoted
from wire.errors import CACHE_SALT_HEADER, REQUEST_FAULT_CODES, STREAM_ERROR_STATUS

MAX_LINE_BYTES = 1 << 20  # one SSE line (a chunk with 20 top log-probabilities per token is a few KB)
# what a stream holds of the tier's bytes ahead of its reader: aiohttp stops reading the socket once its buffer passes
# twice this (the kernel's buffers and TCP's window then hold the tier back), and one read takes at most this. Behind
# a client that does not read its answer, 130 KB wait here (a socket's read more at most); with aiohttp's buffer sized
# MAX_LINE_BYTES, as it was, 2.1 MB did, and a read took all that had come (tests/gateway/test_http_limits.py)
READ_BYTES = 64 << 10
# a stream's data events past CHUNKS_PER_TOKEN * max_tokens + CHUNK_SLACK are an error: a server sends one per step
# of its engine (a token or more each), a few more that carry none (the role, the finish, the usage), and our engine
# up to three for a token that closes a tool call and opens the next (engine/tool_calls.py); an upstream that sends
# more would never end, only at the pace it chooses
CHUNKS_PER_TOKEN = 4
CHUNK_SLACK = 16
MAX_ERROR_BYTES = 64 << 10  # what is read of an upstream's error answer (its message is cut far shorter anyway)
MAX_MESSAGE_CHARS = 500  # what is kept of an upstream's error message that is not an OpenAI error object
MAX_JSON_BYTES = 4 << 20  # a JSON answer (`get_json`: a replica's /health, a remote server's /v1/models)
# an idle pooled connection is dropped before the upstream drops it (uvicorn's default keep-alive is 5 s), so
# a request is rarely written into a connection the other side is closing
KEEPALIVE_S = 4.0
_decode = msgspec.json.Decoder().decode  # what a stream chunk is read with (a chunk's dict, as json.loads gives)
_ON_SENT: ContextVar[Callable[[], None] | None] = ContextVar("tiergate_on_sent", default=None)


class _SentRequest(aiohttp.ClientRequest):
    """aiohttp's request, which tells the caller's `on_sent` (`TierClient.stream_chat`) when it is written to a
    connection: after the connect, which may take up to the connect timeout, and before the upstream can read it.
    A ContextVar carries the callback, as aiohttp hands a request class nothing of the caller's; an aiohttp
    TraceConfig would carry it explicitly, but made each request 20 us slower (240 -> 260 us on one core, one
    request at a time to a local server: every trace signal fires for every request)."""

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        if (on_sent := _ON_SENT.get()) is not None:
            on_sent()
        return await super().send(conn)


class TierClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0,
                 max_connections: int = 1024) -> None:
        # a silent upstream fails after read_timeout_s without data, however long the whole answer: between two
        # reads (aiohttp's sock_read), and between two data events of a stream whatever comes between (`_stream`)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        """The one session (made on first use, inside the event loop that uses it)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                               keepalive_timeout=KEEPALIVE_S),
                request_class=_SentRequest, timeout=self._timeout, read_bufsize=READ_BYTES, auto_decompress=False)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, url: str, *, timeout_s: float = 2.0, api_key: str | None = None) -> dict[str, Any]:
        try:
            async with self._http().get(url, headers=_auth(api_key),
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                content = await _read_at_most(resp, MAX_ERROR_BYTES if resp.status != 200 else MAX_JSON_BYTES + 1)
        except TimeoutError as exc:
            raise UpstreamTimedOut(f"{url}: no answer in {timeout_s}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(_failure(url, exc)) from exc
        if resp.status != 200:
            raise UpstreamRejected(resp.status, _json_or_text(content))
        if len(content) > MAX_JSON_BYTES:
            raise UpstreamProtocolError(f"{url}: the answer is longer than {MAX_JSON_BYTES} bytes")
        try:
            body = json.loads(content)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise UpstreamProtocolError(f"{url}: the answer is not JSON: {content[:200]!r}") from exc
        if not isinstance(body, dict):
            raise UpstreamProtocolError(f"{url}: the answer is not a JSON object")
        return body

    def stream_chat(self, base_url: str, body: dict[str, Any], *, api_key: str | None = None,
                    cache_salt: str | None = None,
                    on_sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming chat completion; yield each `data:` chunk as a dict. `cache_salt`: our engine's prefix
        cache namespace for the request (wire.errors.CACHE_SALT_HEADER). `on_sent()` is called as the request is
        written to a connection (again if a closed pooled connection makes it written a second time); never when
        no connection could be made."""
        return self._stream(base_url.rstrip("/") + "/v1/chat/completions", body, api_key, cache_salt, on_sent)

    async def stream_completion(self, base_url: str, body: dict[str, Any], *, api_key: str | None = None,
                                cache_salt: str | None = None,
                                on_sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming legacy text completion; yield each chunk in the chat chunks' shape (`as_chat_chunk`),
        so that one meter reads both."""
        async for chunk in self._stream(base_url.rstrip("/") + "/v1/completions", body, api_key, cache_salt,
                                        on_sent):
            yield as_chat_chunk(chunk)

    async def _stream(self, url: str, body: dict[str, Any], api_key: str | None, cache_salt: str | None = None,
                      on_sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The stream's `data:` payloads as dicts, up to `[DONE]`. What has arrived is read at once and cut into
        lines here (not one await of aiohttp's line reader per line: two a chunk, most of a chunk's cost); a line
        still unfinished after MAX_LINE_BYTES is an error, as it was with aiohttp's reader. What an upstream may
        send is bounded in time and size: comments and blank lines (an SSE keep-alive) are no data, and a stream
        with none for the read timeout has timed out, however often they come; more than MAX_LINE_BYTES read
        without data (sent as fast as the network goes, each line parsed on the event loop) is an error, and so
        are data events past what the body's `max_tokens` allows (CHUNKS_PER_TOKEN)."""
        headers = {"content-type": "application/json", **_auth(api_key)}
        if cache_salt is not None:
            headers[CACHE_SALT_HEADER] = cache_salt
        done = False
        read_timeout = self._timeout.sock_read
        max_tokens = body.get("max_tokens")
        max_events = CHUNKS_PER_TOKEN * max_tokens + CHUNK_SLACK if isinstance(max_tokens, int) else sys.maxsize
        clock = time.monotonic
        try:
            sending = _ON_SENT.set(on_sent)
            try:
                response = await self._post(url, msgspec.json.encode(body), headers)
            finally:
                _ON_SENT.reset(sending)
            async with response as resp:
                if resp.status != 200:
                    raise UpstreamRejected(resp.status, _json_or_text(await _read_at_most(resp, MAX_ERROR_BYTES)))
                try:
                    pending: list[bytes] = []  # the pieces of an unfinished last line
                    pending_bytes = 0
                    events = 0  # data events read
                    failed = False  # the event being read is named `error`
                    quiet = 0.0  # seconds spent waiting for bytes since the last data event
                    filler = 0  # bytes read since the last data event
                    while not done:
                        waited = clock()
                        got = await resp.content.read(READ_BYTES)
                        quiet += clock() - waited
                        filler += len(got)
                        seen = events
                        lines: list[bytes] = []
                        if got and b"\n" not in got:  # more of one line: kept, joined once its end comes
                            pending.append(got)
                            pending_bytes += len(got)
                        else:
                            lines = b"".join([*pending, got]).split(b"\n")
                            last = lines.pop() if got else b""  # at the end, an unfinished line is a line
                            pending, pending_bytes = ([last], len(last)) if last else ([], 0)
                        for line in lines:
                            if not line.startswith(b"data:"):  # a comment, another field, a blank line
                                if line.startswith(b"event:"):  # the event's name
                                    failed = line[6:].strip() == b"error"
                                elif failed and not line.strip():  # a blank line ends an event
                                    failed = False
                                continue
                            data = line[5:].strip()
                            if failed:  # `event: error`: its data is the upstream's error, whatever its shape
                                raise UpstreamRejected(*_error_event(url, data))
                            if data == b"[DONE]":
                                done = True
                                break
                            events += 1
                            if events > max_events:
                                raise UpstreamProtocolError(f"{url}: the stream sent more events than "
                                                            f"max_tokens={max_tokens} allows")
                            yield _chunk(url, data)
                        if not got or done:
                            break
                        if events != seen:
                            quiet, filler = 0.0, 0
                        elif read_timeout is not None and quiet > read_timeout:
                            raise UpstreamTimedOut(f"{url}: no data in {read_timeout}s (only comments or blank "
                                                   "lines)")
                        elif filler - pending_bytes > MAX_LINE_BYTES:  # not counting a data line still coming
                            raise UpstreamProtocolError(f"{url}: more than {MAX_LINE_BYTES} bytes of the stream "
                                                        "without data")
                        if pending_bytes > MAX_LINE_BYTES:
                            raise UpstreamProtocolError(f"{url}: a line of the stream is longer than "
                                                        f"{MAX_LINE_BYTES} bytes")
                    if not done:
                        raise UpstreamProtocolError(f"{url}: the stream ended without [DONE]")
                    await resp.read()  # to the end of the body, so the connection goes back to the pool
                finally:
                    if not done:
                        resp.close()  # left early (cancelled, or an error): drop the connection, the engine aborts
        except TimeoutError as exc:
            raise UpstreamTimedOut(f"{url}: no data in {self._timeout.sock_read}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(_failure(url, exc)) from exc

    async def _post(self, url: str, data: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """The upstream's response; a pooled connection the upstream had just closed (the request could not be
        written, or no answer came) is retried once on a new one: that request never reached the upstream."""
        try:
            return await self._http().post(url, data=data, headers=headers)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # could not connect at all: no retry
                raise
            return await self._http().post(url, data=data, headers=headers)


def as_chat_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    """A legacy `text_completion` chunk as a chat chunk: each choice's `text` as `delta.content`, and legacy
    log-probabilities (`tokens`, `token_logprobs`) as chat's `logprobs.content` entries."""
    choices = []
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            choice = dict(choice)
            text = choice.pop("text", None)
            choice["delta"] = {"content": text} if isinstance(text, str) else {}
            legacy = choice.pop("logprobs", None)
            if isinstance(legacy, dict) and isinstance(legacy.get("tokens"), list) \
                    and isinstance(logprobs := legacy.get("token_logprobs"), list):
                choice["logprobs"] = {"content": [
                    {"token": token, "logprob": logprob, "bytes": None, "top_logprobs": []}
                    for token, logprob in zip(legacy["tokens"], logprobs, strict=False)
                    if isinstance(logprob, int | float)]}
        choices.append(choice)
    return {**chunk, "choices": choices}


def _failure(url: str, exc: aiohttp.ClientError) -> str:
    """aiohttp's error as one line, without the request it was about. A ClientResponseError (an answer whose head
    cannot be read, a redirect loop) holds that request in its repr, headers and all: the tier's API key, which
    this text took into the log and into the replica's reason on /health and the dashboard. Its message is the
    upstream's bytes as aiohttp words them, over several lines: `quoted`, as any upstream's text."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{url}: {type(exc).__name__}(status={exc.status}, message={quoted(exc.message)})"
    return f"{url}: {exc!r}"


def _auth(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body's first `limit` bytes (all of it if shorter). The rest is never read: an upstream's body of any
    length, or one that never ends, is neither held in memory nor waited for; a connection left with unread bytes is
    closed, not pooled."""
    parts: list[bytes] = []
    size = 0
    while size < limit and (got := await resp.content.read(limit - size)):
        parts.append(got)
        size += len(got)
    if not resp.content.at_eof():
        resp.close()
    return b"".join(parts)


def _chunk(url: str, data: bytes) -> dict[str, Any]:
    try:
        chunk = _decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the decoder's depth
        raise UpstreamProtocolError(f"{url}: a stream chunk is not JSON: {data[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise UpstreamProtocolError(f"{url}: a stream chunk is not a JSON object: {data[:200]!r}")
    if (choices := chunk.get("choices")) and not isinstance(choices, list):  # every reader iterates them
        raise UpstreamProtocolError(f"{url}: a stream chunk's choices are not a list: {data[:200]!r}")
    if chunk.get("error") is not None:
        # the upstream failed after the headers were sent: an error event, not content
        raise UpstreamRejected(_stream_error_status(chunk), chunk)
    return chunk


def _error_event(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-shaped body of an `event: error`'s data: an error object as an error chunk's, any other
    data as an error's message (500: the tier failed). Data longer than MAX_ERROR_BYTES, what is read of an error
    answer's body, is a protocol error, not parsed: a line may be up to MAX_LINE_BYTES, and each was parsed and
    decoded whole on the event loop for a message cut at MAX_MESSAGE_CHARS."""
    if len(data) > MAX_ERROR_BYTES:
        raise UpstreamProtocolError(f"{url}: an error event longer than {MAX_ERROR_BYTES} bytes")
    body = _json_or_text(data)
    if not isinstance(body.get("error"), dict):
        message = body.get("message") if isinstance(body.get("message"), str) else _text(data)
        body = {"error": {"message": message[:MAX_MESSAGE_CHARS], "type": "api_error"}}
    return _stream_error_status(body), body


def _stream_error_status(chunk: dict[str, Any]) -> int:
    """The HTTP status an error event stands for: 503 for a stopped engine; 400 for a request that failed by its
    own content (wire.errors.REQUEST_FAULT_CODES: a healthy replica's answer, which no breaker counts); the 400 or
    429 our engine's event says it stands for (wire.errors.STREAM_ERROR_STATUS: a request refused as it starts, or
    the engine full then); 500 for any other failure. Not by the event's `type`: an upstream's own fault (a bad key,
    an unknown model) is an `invalid_request_error` too. A refusal as the request started was a 500, a 502 to the
    tenant and a failure on the replica's breaker."""
    err = chunk.get("error")
    if not isinstance(err, dict):
        return 500
    if err.get("code") in REQUEST_FAULT_CODES:
        return 400
    if (status := err.get(STREAM_ERROR_STATUS)) in (400, 429) and type(status) is int:
        return status
    return 503 if err.get("code") == "engine_dead" else 500


def _json_or_text(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
        if isinstance(body, dict):
            return body
    except (ValueError, RecursionError):  # not JSON (or cut at MAX_ERROR_BYTES), or nested past the parser's depth
        pass
    return {"error": {"message": _text(content), "type": "api_error"}}


def _text(content: bytes) -> str:
    """The first MAX_MESSAGE_CHARS characters of `content`, decoded from no more bytes than they can take (4 each in
    UTF-8): a character cut at the end of those bytes lies past them."""
    return content[:4 * MAX_MESSAGE_CHARS].decode(errors="replace")[:MAX_MESSAGE_CHARS]

