"""What uvicorn does not bound, bounded (gateway/http_limits.py): a request must arrive whole within the deadline,
or its connection is closed; answers longer than the deadline are not cut; a request's line and headers have a size
limit; a client that stops reading its answer is cut off, and its request ends and is settled. Requests pipelined on
one connection: test_http_pipelining.py."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.raw_http import (
    DEADLINE_S,
    ask_big_and_read_nothing,
    connect,
    limited_settings,
    read_until_closed,
    wait_for_rows,
)
from tests.stubs import ServerThread, StubState

SEND_BUFFER = 64 * 1024  # the kernel's send buffer of a client connection of `unread_gateway` (Linux doubles it)


@pytest.fixture
def unread_gateway(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    """`slow_gateway` whose client connections have a fixed send buffer: what the kernel holds of an answer nobody
    reads is known (Linux grows one of loopback's up to tcp_wmem's largest, 4 MB here, otherwise)."""
    with running_gateway(limited_settings(gateway_settings), stub[1], send_buffer=SEND_BUFFER) as gw:
        yield gw


def test_headers_that_never_end_get_a_408_and_the_connection_closed(slow_gateway: Gateway) -> None:
    t0 = time.monotonic()
    socks = [connect(slow_gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
    for sock in socks:
        got, closed = read_until_closed(sock)
        assert got.startswith(b"HTTP/1.1 408 ") and closed - t0 < DEADLINE_S + 3
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(slow_gateway: Gateway) -> None:
    t0 = time.monotonic()
    got, closed = read_until_closed(connect(slow_gateway, b""))
    assert got == b"" and DEADLINE_S - 0.2 < closed - t0 < DEADLINE_S + 3


def test_headers_past_the_size_limit_get_a_431_before_they_end(slow_gateway: Gateway) -> None:
    sock = connect(slow_gateway, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    with contextlib.suppress(OSError):  # the gateway closes the connection as the limit passes
        for _ in range(64):  # 64 MiB offered, a MiB at a time
            sock.sendall(b"a" * (1 << 20))
            sent += 1
    assert sent < 8
    got, _ = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 431 ") and b'"headers_too_large"' in got


@pytest.mark.parametrize("size", [65 * 1024, 100_000])
def test_headers_past_the_size_limit_in_one_read_get_a_431(slow_gateway: Gateway, size: int) -> None:
    """A head that comes whole in one read with its end is refused too, at its header, never handed to the app."""
    sock = connect(slow_gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size
                   + b"\r\nContent-Length: 2\r\n\r\n{}")
    got, _ = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 431 ") and b'"headers_too_large"' in got, got[:200]


@pytest.mark.parametrize("head", [b"X-Big: " + b"a" * (512 * 1024) + b"\r\n",
                                  b"".join(b"X-%d: a\r\n" % i for i in range(1000))], ids=["large", "many"])
def test_a_client_still_sending_a_refused_head_reads_the_431_and_no_reset(slow_gateway: Gateway, head: bytes) -> None:
    """The refused request's rest is read and dropped before the connection closes: closed with it unread, the
    connection was reset under the client, which lost the 431 if it was still sending (every one of 300 here)."""
    for _ in range(10):
        sock = connect(slow_gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head
                       + b"Content-Length: 2\r\n\r\n{}")
        got, _ = read_until_closed(sock)  # a reset raises ConnectionResetError here
        assert got.startswith(b"HTTP/1.1 431 ") and got.endswith(b"}"), got[:200]


def test_a_large_body_after_small_headers_is_not_counted_as_headers(slow_gateway: Gateway) -> None:
    with slow_gateway.client(slow_gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi " * 100_000}]})  # 300 KB of body, its first part read with the headers
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # read and counted


def test_a_body_sent_too_slowly_is_cut_off_and_charges_nothing(slow_gateway: Gateway,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    headers = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer {slow_gateway.tenant_key}\r\nContent-Length: 1000\r\n\r\n").encode()
    sock = connect(slow_gateway, headers + b'{"model": "mid"')
    t0 = time.monotonic()
    for _ in range(3):  # a byte now and then: each resets uvicorn's keep-alive timer, not this deadline
        time.sleep(0.4)
        sock.sendall(b" ")
    got, closed = read_until_closed(sock)
    assert closed - t0 < DEADLINE_S + 3 and b" 200 " not in got
    assert not slow_gateway.stub.requests and not slow_gateway.ledger_rows()
    time.sleep(0.2)  # the app has seen its client gone
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a client leaving is not our fault


def test_an_answer_longer_than_the_deadline_is_not_cut_and_the_connection_serves_again(
        slow_gateway: Gateway) -> None:
    with slow_gateway.client(slow_gateway.tenant_key) as c:  # one kept-alive connection
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 8, "stream": True,
                                                 "messages": [{"role": "user", "content": "STUB:slow hello"}]})
        assert r.status_code == 200 and time.monotonic() - t0 > DEADLINE_S + 0.15  # six words, 0.2 s apart
        assert "data: [DONE]" in r.text
        time.sleep(DEADLINE_S / 2)
        again = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert again.status_code == 200


PIECE_BYTES = 1_000  # what a piece of `STUB:big` brings (each relayed as an event of a little more)


def test_a_client_that_stops_reading_is_cut_off_and_its_request_ends(slow_gateway: Gateway) -> None:
    """50 MB of answer, never read: the gateway's writes pause, and after the stall limit the connection is
    aborted, the upstream closed and the request settled (before: it waited on its client for ever, holding its
    place in the tier's queue). 50,000 pieces of 1,000 characters: the 200 of 100,000 it was are past what a token
    may bring, and the gateway now ends such an answer at the cap's characters (gateway/pipeline/meter.py)."""
    sock = ask_big_and_read_nothing(slow_gateway)
    rows = wait_for_rows(slow_gateway, 1)
    assert len(rows) == 1 and rows[0].status == "cancelled" and 0 < rows[0].output_tokens < 50_000
    deadline = time.monotonic() + 10  # the stub hears the close on its own thread, maybe after the row is written
    while not slow_gateway.stub.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow_gateway.stub.finished == ["disconnected"]  # the upstream was closed, not read to its end
    sock.close()


def test_a_client_cut_off_is_billed_for_what_was_sent_not_for_more_read_after(unread_gateway: Gateway) -> None:
    """Once the client is cut off, nothing more is read from the tier. uvicorn drops, without an error, what is sent
    to a connection that has gone, and Litestar's cancellation of its sending task did not reach it while the tier's
    bytes kept coming: the gateway went on reading the answer, metering it and dropping it, 9-15 MB (10,000 pieces
    and more, all billed) where 3.9 MB had been sent (gateway/routes/answering.py StreamedAnswer). What the client
    was sent is about what its connection's buffers hold: here 130 KB of the gateway's, 32 KB of the client's."""
    sock = ask_big_and_read_nothing(unread_gateway)
    rows = wait_for_rows(unread_gateway, 1)
    sock.close()
    assert len(rows) == 1 and rows[0].status == "cancelled"
    assert 0 < rows[0].output_tokens * PIECE_BYTES < 1_000_000, rows[0].output_tokens  # about 200 pieces


def test_a_client_cut_off_has_its_connection_reset_and_nothing_more_sent(unread_gateway: Gateway) -> None:
    """The cut drops what the kernel holds for the client too: its connection is reset. An abort drops only the
    transport's buffer, and the socket's close left the kernel sending the rest (4 MB here, with the send buffer
    Linux grows) to a client that read none of it, the socket in FIN-WAIT-1, outside the connection cap, for as
    long as the client kept its window shut (gateway/http_limits.py `_reset`); the client could then read it all and
    an orderly end, as if the answer had ended there."""
    sock = ask_big_and_read_nothing(unread_gateway)
    wait_for_rows(unread_gateway, 1)
    got = 0
    with pytest.raises(ConnectionResetError), contextlib.closing(sock):  # what it had received, then the reset
        while chunk := sock.recv(65536):
            got += len(chunk)
    assert got <= 64 * 1024


def test_clients_that_stop_reading_hold_little_of_the_gateways_memory(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    """What the gateway holds of a tier's answer ahead of a client that does not read it is bounded (tiers/client.py
    READ_BYTES): the tier client's buffer stops taking the tier's bytes (TCP's window then holds the tier back), and
    the pipeline takes no more of them while the client's writes are paused. Before, aiohttp's buffer took 2.1 MB
    ahead of each. Measured as the most Python allocated while 8 such clients stall at once, until their stall limit
    cuts them off (tracemalloc's peak, the stub upstream's 0.4 MB a request included): 0.9-1.2 MB a client, 2.1-3.0
    before."""
    n, stall_s = 8, 3.0  # their stalls overlap: each pauses within a second of its start
    with running_gateway(limited_settings(gateway_settings, stall_s), stub[1], send_buffer=SEND_BUFFER) as gw:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            socks = [ask_big_and_read_nothing(gw) for _ in range(n)]
            rows = wait_for_rows(gw, n)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        for sock in socks:
            sock.close()
    assert len(rows) == n and {r.status for r in rows} == {"cancelled"}
    assert peak < n * 1_600_000, f"{peak / n / 1e6:.1f} MB a client"


def test_a_request_answered_before_its_body_came_keeps_the_deadline(slow_gateway: Gateway) -> None:
    """A wrong key gets its 401 before the body is read; the body arriving after must not end the deadline (a
    client could then go quiet for ever), nor count as the next request's headers."""
    body = b'{"model": "mid", "messages": [{"role": "user", "content": "' + b"x" * 100_000 + b'"}]}'
    sock = connect(slow_gateway, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  f"Authorization: Bearer tg-wrong\r\nContent-Length: {len(body)}\r\n\r\n").encode())
    time.sleep(0.3)  # the 401 is sent before the body comes
    sock.sendall(body)  # more than the head limit: not a head
    t0 = time.monotonic()
    got, closed = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 401 ") and b" 431 " not in got
    assert closed - t0 < DEADLINE_S + 3  # silent after its body: closed by the deadline


def test_an_empty_data_version_header_counts_as_absent(slow_gateway: Gateway) -> None:
    with slow_gateway.client(slow_gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", headers={"x-tiergate-data-version": ""},
                   json={"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_client_cannot_write_a_log_line_per_request(slow_gateway: Gateway) -> None:
    """uvicorn warned once per malformed request and per unsupported upgrade, before any key is read: one client
    with none wrote thousands of lines a second. Each still gets its answer; the log holds a line a minute at most."""
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        for _ in range(100):
            answer, _ = read_until_closed(connect(slow_gateway, b"GARBAGE\x00 / HTTP/1.1\r\n\r\n"))
            assert answer.startswith(b"HTTP/1.1 400")
        with contextlib.closing(connect(slow_gateway, b"")) as sock:
            for _ in range(100):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: foo\r\n\r\n")
                got = b""
                while b"\r\n\r\n" not in got:
                    got += sock.recv(65536)
                head, _, body = got.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                while len(body) < length:
                    body += sock.recv(65536)
                assert head.startswith(b"HTTP/1.1 ")  # answered, and the connection serves on
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert sum("Invalid HTTP request" in m for m in records.messages) <= 1
    assert sum("Unsupported upgrade" in m for m in records.messages) <= 1


@pytest.mark.parametrize("raw", [
    b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 45\r\n\r\n0\r\n\r\n",
    b"POST /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\n",
    b"NOT HTTP AT ALL\r\n\r\n"], ids=["cl-and-te", "two-cl", "chunk-size", "garbage"])
def test_a_request_the_parser_refuses_gets_a_400_in_openais_shape_and_nothing_after_it_runs(
        slow_gateway: Gateway, raw: bytes) -> None:
    """uvicorn answered these "Invalid HTTP request received." in plain text; what follows (a smuggled request) is
    never answered."""
    sock = connect(slow_gateway, raw + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    got, _ = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 400 ") and got.count(b"HTTP/1.1 ") == 1, got[:300]
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_a_chunked_body_whose_framing_never_ends_gets_a_413_and_the_connection_closed(slow_gateway: Gateway) -> None:
    """One chunk's extension, 4.5 MiB of it, to an app waiting on the body: the app's limit counts only the body's
    data (none here), so the gateway read and parsed it all, for as long as the client sent (1.7 GB in 3 s, a
    probe), and said nothing. Now past 4 times the body limit (1 MiB here) the client gets a 413 and the end."""
    sock = connect(slow_gateway, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  f"Authorization: Bearer {slow_gateway.tenant_key}\r\n"
                                  f"Transfer-Encoding: chunked\r\n\r\n1;").encode())
    with contextlib.suppress(OSError):
        sock.sendall(b"a" * (4 * (1 << 20) + 512 * 1024))
    got, _ = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 413 "), got[:300]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "payload_too_large"
    assert slow_gateway.ledger_rows() == []  # nothing ran, nothing billed
