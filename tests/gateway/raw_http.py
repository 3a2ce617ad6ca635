"""A gateway with tight HTTP limits, and raw connections to it: what the tests of the HTTP limits
(test_http_limits.py), of requests pipelined on one connection (test_http_pipelining.py) and of the least read rate
(test_http_read_rate.py) share. The gateway itself is tests/gateway/conftest.py's `slow_gateway`."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

from gateway.settings import Settings
from tests.conftest import Gateway

DEADLINE_S = 1.0


def limited_settings(gateway_settings: Settings, stall_s: float = DEADLINE_S) -> Settings:
    """The deadline, a write stall limit of `stall_s`, and tiers with room for an answer of 50,000 tokens (`STUB:big`'s,
    more than the sockets between the client and the gateway hold, in pieces no larger than a token may bring:
    gateway/pipeline/meter.py MAX_TOKEN_CHARS)."""
    tiers = gateway_settings.tiers_file.with_name("tiers-roomy.yaml")
    tiers.write_text(gateway_settings.tiers_file.read_text().replace("context_limit: 4096", "context_limit: 65536"))
    return gateway_settings.model_copy(update={"request_receipt_timeout_s": DEADLINE_S, "tiers_file": tiers,
                                               "response_stall_timeout_s": stall_s, "max_body_bytes": 1 << 20})


def connect(gw: Gateway, sent: bytes, *, receive_buffer: int | None = None) -> socket.socket:
    """A connection that has sent `sent`; `receive_buffer`: its socket's buffer, fixed (Linux grows one of loopback's
    up to tens of megabytes otherwise)."""
    url = urlparse(gw.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((url.hostname, url.port))
    sock.sendall(sent)
    sock.settimeout(DEADLINE_S + 5)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the gateway sent until it closed the connection, and when it closed (time.monotonic)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got, time.monotonic()


def ask_big_and_read_nothing(gw: Gateway) -> socket.socket:
    """A connection that asked for `STUB:big`'s 50,000 pieces of 1,000 characters (50 MB) and reads none of it."""
    body = json.dumps({"model": "mid", "stream": True, "max_tokens": 50_000,
                       "messages": [{"role": "user", "content": "STUB:big"}]}).encode()
    return connect(gw, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Authorization: Bearer {gw.tenant_key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
                   + body, receive_buffer=16384)


def wait_for_rows(gw: Gateway, n: int, timeout_s: float = 20) -> list:
    deadline = time.monotonic() + timeout_s
    while len(rows := gw.ledger_rows()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return rows
