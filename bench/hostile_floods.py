"""bench/hostile_tenant.py's two floods at the gateway's size limits, and the raw-socket sender the second needs.

- A body as wide as the body limit allows (160,512 content parts in 4 MiB) with a `NaN` in a tool's `parameters`:
  not JSON (such bodies once skipped the width check and were validated part by part).
- A header flood: as many headers as allowed, padded to just under the head's size limit; then ten times the count;
  then one 512 KiB header. httpx adds headers of its own, so these go out on a socket as written (`raw_post`).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import httpx

from gateway.http_responses import MAX_HEAD_BYTES, MAX_HEADERS

BIG_HEADER = 8 * MAX_HEAD_BYTES  # the header flood's one header past the size limit (see header_flood)
HEADER_FLOOD = (f"a header flood ({MAX_HEADERS} headers in {MAX_HEAD_BYTES // 1024 - 4} KiB, "
                f"{10 * MAX_HEADERS:,} headers, one of {BIG_HEADER // 1024} KiB)")  # its attack's name


def nan_wide(max_body_bytes: int) -> bytes:
    """A chat body of as many messages of 256 empty text parts as fit in `max_body_bytes` (4 MiB: 627, 160,512
    parts), with a `NaN` in a tool's parameters (json.dumps writes float("nan") so): not JSON."""
    def body(messages: int) -> bytes:
        return json.dumps({"model": "mid", "max_tokens": 4, "tool_choice": "none",
                           "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 256}] * messages,
                           "tools": [{"type": "function", "function": {
                               "name": "f", "parameters": {"type": "object", "x": float("nan")}}}]},
                          separators=(",", ":")).encode()
    per_message = len(body(2)) - len(body(1))
    return body(max(1, (max_body_bytes - len(body(0))) // per_message))


def nan_wide_name(body: bytes) -> str:
    """The NaN flood's attack name, for `body` (from nan_wide)."""
    parts = body.count(b'{"type":"text"')
    return f"NaN in a tool's parameters of {parts:,} content parts ({len(body) / 1e6:.1f} MB)"


def header_flood() -> list[list[tuple[str, str]]]:
    """The header flood's requests, besides their host, key, content type and length (4 header lines): as many
    headers as allowed padded to 4 KiB under the head's size limit (read: its `{}` body is then refused, the
    headers charged to the tenant's refused bytes); ten times as many as allowed (431 too_many_headers); one header
    of BIG_HEADER bytes (431 headers_too_large). That one is 8 times the limit, not just past it: the gateway counts
    a head's bytes by the reads before the one that ends it (asyncio reads up to 256 KiB at a time), so a head of
    64 to 256 KiB that comes in one read is read whole and answered by the app."""
    n = MAX_HEADERS - 4
    pad = (MAX_HEAD_BYTES - 4096) // n - len("x-pad-00: \r\n")
    return [[(f"x-pad-{i:02d}", "a" * pad) for i in range(n)],
            [(f"x-{i}", "a") for i in range(10 * MAX_HEADERS)],
            [("x-big", "a" * BIG_HEADER)]]


def header_flood_sender() -> Callable[[httpx.Client], int]:
    """The header flood's `send`: each call the next of header_flood's requests, in turn (the second call first)."""
    flood = header_flood()
    state = {"sent": 0}

    def send(c: httpx.Client) -> int:
        state["sent"] += 1
        return raw_post(c, flood[state["sent"] % len(flood)])
    return send


def raw_post(c: httpx.Client, headers: list[tuple[str, str]], body: bytes = b"{}") -> int:
    """A chat request with `c`'s key and exactly `headers` besides its host, key, content type and length, sent as
    written (httpx adds its own) on a connection of its own: the answer's status."""
    host, port = c.base_url.host, c.base_url.port
    head = [("host", f"{host}:{port}"), ("authorization", c.headers["authorization"]), *headers,
            ("content-type", "application/json"), ("content-length", str(len(body)))]
    raw = "POST /v1/chat/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head) + "\r\n"
    try:
        with socket.create_connection((host, port), timeout=120) as sock:
            sock.sendall(raw.encode() + body)
            got = b""
            while not _whole(got):
                if not (chunk := sock.recv(65536)):
                    break
                got += chunk
    except OSError as exc:
        raise httpx.TransportError(repr(exc)) from exc
    if not got.startswith(b"HTTP/1.1 "):
        raise httpx.RemoteProtocolError(f"no answer: {got[:80]!r}")
    return int(got.split(b" ", 2)[1])


def _whole(got: bytes) -> bool:
    """An answer's head has come, and as much body as its content-length says."""
    head, sep, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in lines if line.startswith("content-length:")), 0)
    return bool(sep) and len(body) >= length
