"""A mock OpenAI-compatible upstream far faster than the gateway, so a benchmark in front of it times the gateway.

    .venv/bin/python -m bench.gateway_mock --port 18700 [--tokens 8]

It answers as our engine does (its chunks come from `wire.responses`, the builders the engine's server
uses): POST /v1/chat/completions streamed (SSE: a role chunk, one chunk per token with `usage` and
`x_tiergate.busy_s` when `stream_options.continuous_usage_stats` is set, a finish chunk, a usage chunk
when `include_usage` is set, `[DONE]`) or whole (one JSON completion with usage and busy time);
GET /v1/models and GET /health. Each answer has `--tokens` tokens (fewer when `max_tokens` asks).

Lean on purpose: a raw asyncio protocol on uvloop with httptools' parser (both come with uvicorn[standard]),
no framework, and every answer rendered once per shape (model, tokens, stream options, prompt length)
and then written from a cache in one `write`. The whole stream goes out at once: the gateway's relay
cost per chunk is what is left to time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
from typing import Any

import httptools

from wire import responses

BUSY_S_PER_TOKEN = 0.001  # what the mock says each token cost the engine (the gateway's compute-cost meter reads it)
MAX_BODY_BYTES = 8 * 1024 * 1024


def _head(status: str, content_type: bytes, extra: bytes, close: bool) -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n" + extra
            + (b"connection: close\r\n" if close else b"") + b"\r\n")


def json_response(status: str, payload: dict[str, Any], close: bool = False) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return _head(status, b"application/json", b"content-length: %d\r\n" % len(body), close) + body


def _error(status: str, message: str, close: bool = False) -> bytes:
    return json_response(status, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                            "code": None}}, close)


@functools.lru_cache(maxsize=4096)
def render_chat(model: str, num_tokens: int, finish: str, prompt_tokens: int, stream: bool, include_usage: bool,
                continuous: bool) -> bytes:
    """The body (and the headers' framing) of one answer; cached, since the same shapes repeat."""
    ids = {"id_": "chatcmpl-mock", "created": 0, "model": model}
    words = [f" t{i}" for i in range(num_tokens)]
    busy = BUSY_S_PER_TOKEN * num_tokens
    if not stream:
        payload = responses.completion(**ids, text="".join(words), finish_reason=finish,
                                       prompt_tokens=prompt_tokens, completion_tokens=num_tokens,
                                       x_tiergate={"busy_s": busy})
        body = json.dumps(payload, separators=(",", ":")).encode()
        return b"content-length: %d\r\n\r\n" % len(body) + body
    events = [responses.sse(responses.chunk(**ids, delta={"role": "assistant", "content": ""}))]
    for i, word in enumerate(words):
        extra: dict[str, Any] = {}
        if continuous:
            extra = {"usage": responses.usage(prompt_tokens, i + 1),
                     "x_tiergate": {"busy_s": BUSY_S_PER_TOKEN * (i + 1)}}
        events.append(responses.sse(responses.chunk(**ids, delta={"content": word}, **extra)))
    events.append(responses.sse(responses.chunk(**ids, delta={}, finish_reason=finish,
                                                x_tiergate={"busy_s": busy})))
    if include_usage:
        events.append(responses.sse(responses.usage_chunk(**ids, prompt_tokens=prompt_tokens,
                                                          completion_tokens=num_tokens, x_tiergate={"busy_s": busy})))
    events.append(responses.SSE_DONE)
    # HTTP/1.1 chunked framing, one chunk per event, as a streaming server writes them
    framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n" + framed


def chat_answer(raw: bytes, max_tokens: int, close: bool) -> bytes:
    """The whole HTTP response to one POST /v1/chat/completions body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return _error("400 Bad Request", "the body is not JSON", close)
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return _error("400 Bad Request", "`messages` is required", close)
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    cap = cap if isinstance(cap, int) and cap > 0 else None
    num_tokens = min(max_tokens, cap or max_tokens)
    finish = "length" if num_tokens == cap else "stop"  # as a model that ends its answer before the cap
    prompt_tokens = sum(len(m.get("content", "").split()) for m in body["messages"]
                        if isinstance(m, dict) and isinstance(m.get("content"), str))
    opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    stream = body.get("stream") is True
    framing = render_chat(str(body.get("model") or "mock"), num_tokens, finish, prompt_tokens, stream,
                          bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats")))
    content_type = b"text/event-stream" if stream else b"application/json"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n" + (b"connection: close\r\n" if close else b"")
    return head + framing


class MockProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; answers each request as soon as its body is complete."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(_error("400 Bad Request", "malformed HTTP request", close=True), close=True)

    def on_message_begin(self) -> None:
        self.url, self.body, self.size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY_BYTES:
            self._send(_error("413 Payload Too Large", "body too large", close=True), close=True)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        close = not self.parser.should_keep_alive()
        method, path = self.parser.get_method(), self.url.split(b"?", 1)[0]
        if method == b"POST" and path == b"/v1/chat/completions":
            answer = chat_answer(b"".join(self.body), self.max_tokens, close)
        elif method == b"GET" and path == b"/v1/models":
            answer = json_response("200 OK", {"object": "list", "data": [
                {"id": "mock", "object": "model", "created": 0, "owned_by": "bench"}]}, close)
        elif method == b"GET" and path == b"/health":
            answer = json_response("200 OK", {"status": "ok"}, close)
        else:
            answer = _error("404 Not Found", f"no route {method.decode()} {path.decode(errors='replace')}", close)
        self._send(answer, close)

    def _send(self, data: bytes, close: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(data)
        if close:
            self.transport.close()


async def start_mock(host: str, port: int, max_tokens: int = 8) -> asyncio.Server:
    """Listen on host:port in the running loop (port 0: any free port; read it from `server.sockets`)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: MockProtocol(max_tokens), host, port, backlog=4096)


async def _serve(host: str, port: int, max_tokens: int) -> None:
    server = await start_mock(host, port, max_tokens)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer (fewer when max_tokens asks)")
    args = parser.parse_args()
    import uvloop

    uvloop.run(_serve(args.host, args.port, args.tokens))


if __name__ == "__main__":
    main()
