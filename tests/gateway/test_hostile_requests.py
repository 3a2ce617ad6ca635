"""What a tenant's refused requests cost it: a request of thousands of tiny headers is refused (431) before the app
reads them; a refused request is charged its headers with its body; a request the tier refuses as the tenant's
fault is charged as one the gateway refused; and a body with `NaN` is refused as not JSON."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hello"}]
MAX_HEADERS = 100  # gateway/http_limits.py's, as Apache's LimitRequestFields


def send(gw: Gateway, headers: list[tuple[str, str]], body: bytes = b"{}") -> tuple[int, dict]:
    """A chat request with exactly `headers` (and its length), sent raw: its status and error."""
    url = urlparse(gw.url)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    raw = f"POST /v1/chat/completions HTTP/1.1\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(raw)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            if not (chunk := sock.recv(65536)):
                break
            got += chunk
    status = int(got.split(b" ", 2)[1])
    return status, json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]


def _length(got: bytes) -> int:
    head = got.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
    return next((int(line.split(":", 1)[1]) for line in head if line.startswith("content-length:")), 0)


@pytest.fixture
def gw(gateway: Gateway) -> Iterator[Gateway]:
    """The gateway with a refused-requests bucket of 4 KB that does not refill during a test."""
    gate = gateway.app.state.services.pipeline.gate
    gate.refused_bytes_burst, gate.refused_bytes_per_s = 4096, 1e-3
    yield gateway


def test_more_headers_than_the_limit_get_a_431(gw: Gateway) -> None:
    key = [("host", "x"), ("authorization", f"Bearer {gw.tenant_key}"), ("content-type", "application/json")]
    filler = [(f"x-{i}", "a") for i in range(7000)]
    status, err = send(gw, key + filler[:MAX_HEADERS - len(key) - 1])  # content-length makes MAX_HEADERS
    assert status == 400 and err["param"] == "model"  # read: the body is refused
    status, err = send(gw, key + filler)
    assert status == 431 and err["code"] == "too_many_headers" and set(err) == {"message", "type", "param", "code"}


def test_a_refused_request_is_charged_its_headers(gw: Gateway) -> None:
    key = [("host", "x"), ("authorization", f"Bearer {gw.tenant_key}"), ("content-type", "application/json")]
    assert send(gw, [*key, ("x-pad", "a" * 5000)])[0] == 400  # a body of 2 bytes, under 5 KB of headers
    status, err = send(gw, key, json.dumps({"model": "mid", "messages": MSG}).encode())
    assert status == 429 and err["code"] == "rate_limit_invalid_requests"


def test_a_request_the_tier_refuses_is_charged_as_refused(gw: Gateway) -> None:
    pad = "x" * 5000  # past the 4 KB bucket
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [
            {"role": "user", "content": f"STUB:400 {pad}"}]})
        assert r.status_code == 400 and len(gw.stub.requests) == 1  # the tier's refusal, relayed
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_invalid_requests", r.text
    assert len(gw.stub.requests) == 1


def test_a_body_with_nan_is_not_json(gw: Gateway) -> None:
    body = (b'{"model": "mid", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "parameters": {"type": "object", "x": NaN}}}]}')
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert gw.stub.requests == []
