"""Requests pipelined on one connection (gateway/http_limits.py, gateway/http_refusals.py): HTTP/1.1 answers them in
order, so a request behind another is answered after it, whole and not cut by the deadline, and one refused at its
head is refused after the one before it is answered; the requests queued and the bytes read behind a refusal are
bounded."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from gateway import http_limits
from gateway.http_refusals import MAX_PIPELINED
from tests.conftest import Gateway
from tests.gateway.held_answer import held_answer
from tests.gateway.raw_http import connect, read_until_closed
from tests.stubs import ServerThread


def test_a_pipelined_request_is_not_cut_by_the_deadline(slow_gateway: Gateway) -> None:
    """Two requests sent at once on one connection: the second, answered after the first, streams for longer than
    the deadline and is not cut."""
    def request(content: str) -> bytes:
        body = json.dumps({"model": "mid", "max_tokens": 8, "stream": True,
                           "messages": [{"role": "user", "content": content}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {slow_gateway.tenant_key}\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    sock = connect(slow_gateway, request("hello") + request("STUB:slow hello"))
    got, buffer = 0, b""
    deadline = time.monotonic() + 10
    while got < 2 and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buffer += chunk
        got = buffer.count(b"data: [DONE]")
    sock.close()
    assert got == 2, buffer[-300:]  # both answers whole; the second took 1.2 s of a 1 s deadline


def test_requests_pipelined_past_the_head_limit_in_one_write_are_answered(slow_gateway: Gateway) -> None:
    """30 requests of 4 KB sent in one write (and the start of one more, finished later): each head is small, but
    a read that ended one request and began the next counted all of its bytes as the new head's, so the connection
    was closed as if one head had passed 64 KiB (reset, no request answered)."""
    one = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000 + b"\r\n\r\n"
    sock = connect(slow_gateway, one * 30 + one[:20])
    sock.sendall(one[20:] + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got, _ = read_until_closed(sock)
    assert got.count(b"HTTP/1.1 401 ") == 32, got[:300]
    assert got.endswith(b'"code":"missing_api_key"}}')


def test_requests_pipelined_past_the_limit_are_not_parsed_and_the_queued_ones_are_answered(
        slow_gateway: Gateway) -> None:
    """5,000 requests of 18 bytes in one write, no key: uvicorn parsed every one a read brought into a request cycle
    and queued it (20 such connections took 620 MB, and another tenant waited 12 s). Now the parser stops past
    MAX_PIPELINED queued; those are answered, the last one closing the connection."""
    sock = connect(slow_gateway, b"GET / HTTP/1.1\r\n\r\n" * 5000)
    got, _ = read_until_closed(sock)
    answers = got.count(b"HTTP/1.1 ")
    assert 0 < answers <= MAX_PIPELINED + 1, answers
    last_head = got[got.rindex(b"HTTP/1.1 "):].split(b"\r\n\r\n", 1)[0].lower()
    assert b"connection: close" in last_head, last_head


def test_a_queued_request_whose_chunks_break_does_not_answer_ahead_of_the_one_before(slow_gateway: Gateway) -> None:
    """A whole request, and behind it in the same write one whose chunk size is not valid: the 400 for the second
    was written at once, ahead of the first's answer, and the connection's end after it left the first unanswered
    (its client read the 400 as its answer). Now the first is answered, the broken one dropped, then the end."""
    first = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {slow_gateway.tenant_key}\r\n\r\n".encode()
    broken = b"POST /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\n"
    sock = connect(slow_gateway, first + broken + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    got, _ = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 200 "), got[:300]
    assert got.count(b"HTTP/1.1 ") == 1, got[:600]  # nothing after the broken one is read as a request
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and json.loads(body)["object"] == "list"


def _slow_stream(gw: Gateway) -> bytes:
    """A whole chat request whose streamed answer takes about 1.2 s (six words, 0.2 s apart)."""
    body = json.dumps({"model": "mid", "max_tokens": 8, "stream": True,
                       "messages": [{"role": "user", "content": "STUB:slow hello"}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {gw.tenant_key}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


_REFUSED_BEHIND = {  # a request refused at its head, and what it is answered
    "large": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", b"431",
              "headers_too_large"),
    "many": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",
             b"431", "too_many_headers"),
    "encoded": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n"
                b"{}", b"415", "unsupported_content_encoding"),
    "garbage": (b"NOT HTTP AT ALL\r\n\r\n", b"400", "invalid_http_request"),
    "cl-and-te": (b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"0\r\n\r\n", b"400", "invalid_http_request"),
}


@pytest.mark.parametrize("refused", [*_REFUSED_BEHIND, "large-unended"])
def test_a_request_refused_behind_one_being_answered_is_answered_after_it(slow_gateway: Gateway, refused: str) -> None:
    """A slow stream and, pipelined behind it on the same connection, a request refused at its head (a 431, a 415,
    a 400 the parser gives): the stream is answered whole, then the refusal, then the connection ends (HTTP/1.1
    answers requests in order). The connection was closed at once, cutting the stream (or, for the parser's 400s,
    the stream's request was cancelled and the 400 read as its answer)."""
    if refused == "large-unended":  # a head passing the limit in reads that never end it
        sock = connect(slow_gateway, _slow_stream(slow_gateway) + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
        time.sleep(0.1)
        sock.sendall(b"a" * 100_000)
        status, code = b"431", "headers_too_large"
    else:
        request, status, code = _REFUSED_BEHIND[refused]
        sock = connect(slow_gateway, _slow_stream(slow_gateway) + request)
    got, _ = read_until_closed(sock)
    first, _, rest = got.partition(b"0\r\n\r\n")  # the stream's chunked body ends with an empty chunk
    assert first.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in first, got[:300]
    assert rest.startswith(b"HTTP/1.1 " + status + b" "), rest[:300]
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code
    assert slow_gateway.ledger_rows()[0].status == "ok"  # the stream's request ran to its end


def test_what_comes_behind_a_refusal_waiting_on_an_answer_is_read_only_up_to_a_bound() -> None:
    """A request being answered (held until the test releases it) and, pipelined behind it, one refused at its head
    (not HTTP): the refusal waits for the answer, and the bytes the client sends meanwhile were read and dropped for
    as long as the answer took (256 MiB here, all of it). Now past `linger_bytes` (1 MiB) the gateway reads no more:
    the client's sends block once the sockets' buffers are full. The answer is still sent whole, then the 400."""
    release = threading.Event()
    flood, offered = b"a" * (1 << 20), 256 << 20
    with ServerThread(held_answer(release), http=http_limits.limited_protocol(30, 60)).start() as server:
        url = urlparse(server.url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.connect((url.hostname, url.port))
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
            sock.settimeout(10)
            got = b""
            while b"first" not in got and (chunk := sock.recv(65536)):
                got += chunk
            assert got.endswith(b"first"), got  # the answer has begun; the refusal waits behind it
            sent = 0
            sock.settimeout(2)
            with contextlib.suppress(TimeoutError):  # the gateway reads no more: the sockets' buffers fill
                while sent < offered:
                    sock.sendall(flood)
                    sent += len(flood)
            release.set()
            assert sent < offered // 4, f"{sent >> 20} MiB read behind the refusal"
            sock.settimeout(10)
            with contextlib.suppress(ConnectionResetError):  # closed with the client's bytes unread: a reset after
                while chunk := sock.recv(65536):
                    got += chunk
            assert got.split(b"\r\n\r\n", 1)[1].startswith(b"first-rest"), got[:300]  # the answer whole
            refusal = got[got.index(b"first-rest") + len(b"first-rest"):]
            assert refusal.startswith(b"HTTP/1.1 400 ") and b'"invalid_http_request"' in refusal, refusal[:300]
        finally:
            release.set()
            sock.close()
