"""A tenant's gate is passed before its request's body is read (gateway/pipeline/gate.py `Pass`).

The body was read first, whole, and the gate asked after: a tenant allowed one request at a time could open any
number of connections, each sending a body of up to `max_body_bytes` (4 MiB by default) as slowly as the request's
deadline let it, and the gateway held every byte of every one in memory before the first of them was refused. Here a
connection past the tenant's concurrency is answered 429 from its headers alone, its body never read; once the first
request is done (its body cut short, here), its place is free again. Chat, text completions and embeddings alike."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from quotas.plans import Limits
from tests.conftest import Gateway

WAIT_S = 10.0  # the longest a refusal may take here (the request deadline, 30 s, is what the old order waited for)
ROUTES = {"chat": ("/v1/chat/completions", {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}),
          "completions": ("/v1/completions", {"model": "mid", "prompt": "hi"}),
          "embeddings": ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hi"})}


def head(gw: Gateway, path: str, key: str, length: int) -> bytes:
    host = urlparse(gw.url).netloc
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n").encode()


def opened(gw: Gateway, sent: bytes) -> socket.socket:
    url = urlparse(gw.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(sent)
    sock.settimeout(WAIT_S)
    return sock


def in_flight(gw: Gateway, scope: str) -> int:
    return gw.app.state.services.pipeline.gate.in_flight(scope)


def wait_for(check: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("route", ROUTES)
def test_a_connection_past_the_concurrency_is_refused_before_its_body(gateway: Gateway, route: str) -> None:
    key, secret = gateway.store.issue_key("acme", name="one-at-a-time", limits=Limits(max_concurrent=1))
    scope = f"acme/k:{key.key_id}"
    path, body = ROUTES[route]
    payload = json.dumps(body).encode()
    first = opened(gateway, head(gateway, path, secret, 32 << 10) + b"{")  # its body coming slowly: 1 byte of 32 KiB
    try:
        wait_for(lambda: in_flight(gateway, scope) == 1, "the first request never took its place in the gate")
        second = opened(gateway, head(gateway, path, secret, len(payload)))  # its headers only, the body held back
        try:
            answer = second.recv(65536)  # before the fix: nothing until the 30 s deadline (the recv times out)
            assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
            assert b"max_concurrent" in answer or b"concurren" in answer, answer
        finally:
            second.close()
    finally:
        first.close()
    wait_for(lambda: in_flight(gateway, scope) == 0, "the first request's place was never given back")
    with gateway.client(secret) as c:  # and the key's next request is answered
        assert c.post(path, json=body).status_code == 200
