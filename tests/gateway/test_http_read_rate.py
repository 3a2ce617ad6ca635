"""A client that reads its answer, but slower than the gateway's least read rate (gateway/http_limits.py,
"Reading"): a trickle reader, which takes a few bytes within each stall limit and so never stalls a write for that
long, is reset as a reader that stops is, and its request ends; one reading steadily above the rate is not.

On a real uvicorn server with the gateway's protocol and an app that writes as fast as it may (its writes paused
whenever the client's sockets are full). The rule reads only the ratio of what a client takes to the time the
gateway waits on it, so it is tried here scaled to a short test: a stall limit of 1 s, and least rates of MB/s
where the setting's default is KiB/s."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

import pytest
from pydantic import ValidationError

from gateway import http_limits
from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.gateway.held_answer import served
from tests.gateway.raw_http import ask_big_and_read_nothing, limited_settings, wait_for_rows
from tests.stubs import ServerThread, StubState

STALL_S = 1.0
SEND_BUFFER = 16 * 1024  # the server's and the client's socket buffers, fixed: what they hold is small and known
CHUNK = 4096  # what the app writes at a time


def endless_answer(gone: threading.Event) -> Any:
    """An app that streams `CHUNK`s for as long as its client is there, and sets `gone` when it sees it leave."""
    async def answer(receive: Any, send: Any) -> None:
        left = asyncio.ensure_future(receive())  # the request's (empty) body, then http.disconnect
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while True:
            if left.done():
                if left.result()["type"] == "http.disconnect":
                    gone.set()
                    return
                left = asyncio.ensure_future(receive())
            await send({"type": "http.response.body", "body": b"x" * CHUNK, "more_body": True})
            await asyncio.sleep(0)  # uvicorn's send to a client gone returns at once: let the disconnect be heard

    return served(answer)


def sized_answer(size: int, chunk: int = CHUNK) -> Any:
    """An app that answers each request with `size` bytes, `chunk`s written as fast as the client lets it: one write
    of them all where `chunk` is `size`, as a JSON answer or an embeddings body is sent."""
    async def answer(receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % size)]})
        for sent in range(0, size, chunk):
            await send({"type": "http.response.body", "body": b"x" * chunk, "more_body": sent + chunk < size})

    return served(answer)


def protocol(min_read_bytes_per_s: float, pauses: list[float]) -> type[http_limits.LimitedProtocol]:
    """The gateway's protocol with `STALL_S` and `min_read_bytes_per_s`, noting when its writes pause."""
    base = http_limits.limited_protocol(30, STALL_S)

    class Noted(base):  # type: ignore[valid-type, misc]
        def pause_writing(self) -> None:
            pauses.append(time.monotonic())
            super().pause_writing()

    Noted.min_read_bytes_per_s = float(min_read_bytes_per_s)
    return Noted


def ask_endless(url: str) -> socket.socket:
    """A connection that asked `endless_answer` for its answer, with a small receive buffer."""
    parts = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SEND_BUFFER)
    sock.connect((parts.hostname, parts.port))
    sock.settimeout(STALL_S + 5)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def read_in_bursts(sock: socket.socket, burst: int, every_s: float, for_s: float,
                   upto: int | None = None) -> tuple[int, bool]:
    """Read what `sock` is sent `burst` bytes at a time, `every_s` apart, for `for_s` or until `upto` bytes are read,
    then close it: the bytes read and whether the connection was reset meanwhile."""
    got, end = 0, time.monotonic() + for_s
    try:
        while time.monotonic() < end and (upto is None or got < upto):
            time.sleep(every_s)
            want = got + burst if upto is None else min(got + burst, upto)
            while got < want:
                chunk = sock.recv(want - got)
                if not chunk:
                    return got, False  # an orderly end: not what either rule does
                got += len(chunk)
    except ConnectionResetError:
        return got, True
    finally:
        sock.close()
    return got, False


def test_a_trickle_reader_is_reset_and_its_request_ends() -> None:
    """Bursts 0.3 s apart, each more than the sockets' buffers hold, so the paused writes resume each time, well within
    the 1 s stall limit: before, that reset the stall timer every time, and a client taking 64 KB a minute held its
    request (its dispatch place, its engine seat) for as long as the answer lasted (hours, for a long stream). Here it
    takes about 0.6 MB/s where the least rate is 8 MiB/s: the paused time it is allowed (1 s, and 1/8 s a MiB taken)
    runs out within a few bursts, and it is reset, its app seeing its client gone."""
    gone, pauses = threading.Event(), []
    with ServerThread(endless_answer(gone), http=protocol(8 << 20, pauses), send_buffer=SEND_BUFFER).start() as server:
        got, reset = read_in_bursts(ask_endless(server.url), burst=192 * 1024, every_s=0.3, for_s=4.0)
        assert reset, f"{got} bytes read in 4 s over {len(pauses)} paused writes, never reset"
        assert gone.wait(5)  # the request was cancelled: the app heard its client leave
    assert len(pauses) >= 2  # it had resumed the writes in between, so no single pause reached the stall limit


def test_a_trickle_reader_of_a_stream_is_cut_off_and_billed_for_what_ran(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    """The same reader on the gateway: a stream of `STUB:big`'s 50 MB, read in bursts that resume its writes within
    each stall limit. It is reset through the stall's path: the request is cancelled, its upstream closed, and it is
    billed for what ran (before: it ran on for as long as the answer lasted, its place in the tier's queue held)."""
    settings = limited_settings(gateway_settings, STALL_S).model_copy(
        update={"response_min_read_bytes_per_s": float(8 << 20)})
    with running_gateway(settings, stub[1], send_buffer=SEND_BUFFER) as gw:
        got, reset = read_in_bursts(ask_big_and_read_nothing(gw), burst=192 * 1024, every_s=0.3, for_s=8.0)
        assert reset, f"{got} bytes read in 8 s, never reset"
        rows = wait_for_rows(gw, 1)
        assert len(rows) == 1 and rows[0].status == "cancelled" and 0 < rows[0].output_tokens < 50_000
        deadline = time.monotonic() + 10  # the stub hears the close on its own thread, maybe after the row
        while not gw.stub.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gw.stub.finished == ["disconnected"]


def test_a_reader_well_above_the_rate_is_never_reset() -> None:
    """64 KiB every 0.05 s (about 1 MB/s, its writes paused between reads) against a least rate of 64 KiB/s: read
    for 2 s, over many pauses, and never reset."""
    gone, pauses = threading.Event(), []
    with ServerThread(endless_answer(gone), http=protocol(64 << 10, pauses), send_buffer=SEND_BUFFER).start() as server:
        got, reset = read_in_bursts(ask_endless(server.url), burst=64 * 1024, every_s=0.05, for_s=2.0)
        assert not reset and got >= 20 * 64 * 1024
    assert len(pauses) >= 10  # the app wrote faster than it read: its writes waited on it, again and again


def test_a_single_write_read_steadily_above_the_rate_for_longer_than_the_stall_limit_is_not_cut() -> None:
    """A whole answer in one write (a JSON answer, an embeddings body) is one pause for as long as its client takes to
    read it. Read at about 320 KiB/s against a least rate of 64 KiB/s, 512 KiB take well over the 1 s stall limit: its
    client took bytes within every second of it, so the pause goes on and it earns more than it spends. Before, what
    it took was credited only when the pause ended: the pause was cut at 1 s (after about 270 KB), however fast it
    read."""
    pauses: list[float] = []
    size = 512 << 10
    with ServerThread(sized_answer(size, chunk=size), http=protocol(64 << 10, pauses),
                      send_buffer=SEND_BUFFER).start() as server:
        got, reset = read_in_bursts(ask_endless(server.url), burst=16 * 1024, every_s=0.05, for_s=30.0, upto=size)
        assert not reset and got == size, f"{got} of {size} bytes read, reset: {reset}"
    assert len(pauses) == 1  # one write, one pause: what the client took was credited within it


def test_a_single_write_read_below_the_rate_is_cut_once_its_budget_is_spent() -> None:
    """The same single write, 2 MiB, read at about 320 KiB/s against a least rate of 8 MiB/s: each second of the
    pause earns it a twenty-fifth of a second, so it is cut long before its end, its client reading on."""
    pauses: list[float] = []
    size = 2 << 20
    with ServerThread(sized_answer(size, chunk=size), http=protocol(8 << 20, pauses),
                      send_buffer=SEND_BUFFER).start() as server:
        got, reset = read_in_bursts(ask_endless(server.url), burst=16 * 1024, every_s=0.05, for_s=4.0, upto=size)
        assert reset and got < size, f"{got} of {size} bytes read, reset: {reset}"


def test_a_client_that_stops_reading_a_single_write_is_cut_at_the_stall_limit() -> None:
    """Bytes taken within a pause keep it going only while they come: a client that reads the start of a 1 MiB
    single write and then nothing (well past the stall limit, at any least rate) is reset, the rest never sent."""
    pauses: list[float] = []
    size = 1 << 20
    with ServerThread(sized_answer(size, chunk=size), http=protocol(1, pauses),
                      send_buffer=SEND_BUFFER).start() as server, ask_endless(server.url) as sock:
        got = 0
        while got < 64 * 1024:
            got += len(sock.recv(64 * 1024 - got))
        time.sleep(3 * STALL_S)  # credited at the first look, then nothing taken until the next: reset there
        with pytest.raises(ConnectionResetError):
            while got < size and (chunk := sock.recv(65536)):
                got += len(chunk)


def test_the_least_read_rate_is_set_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().response_min_read_bytes_per_s == http_limits.MIN_READ_BYTES_PER_S == 2048
    monkeypatch.setenv("TIERGATE_RESPONSE_MIN_READ_BYTES_PER_S", "512")
    assert http_limits.for_settings(Settings()).min_read_bytes_per_s == 512


def test_each_answer_on_a_kept_alive_connection_has_its_own_budget() -> None:
    """Two answers of 1 MiB on one connection, each waited on 0.6 s before it is read whole: either fits the 1 s of
    paused time an answer has (at 8 MiB/s, what it takes earns it little more), and neither is cut, where the two
    pauses together would be."""
    pauses: list[float] = []
    size = 1 << 20
    with ServerThread(sized_answer(size), http=protocol(8 << 20, pauses), send_buffer=SEND_BUFFER).start() as server:
        sock = ask_endless(server.url)
        with sock:
            for i in range(2):
                if i:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                time.sleep(0.6)  # the answer's writes pause meanwhile: the sockets hold far less than it
                head = b""
                while b"\r\n\r\n" not in head:
                    head += sock.recv(4096)
                head, _, body = head.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                got = len(body)
                while got < size:  # a reset raises ConnectionResetError here
                    got += len(sock.recv(65536))
                assert got == size
    assert len(pauses) >= 2


@pytest.mark.parametrize("rate", ["0", "-1", "inf", "nan"])
def test_a_least_read_rate_not_finite_and_positive_is_refused(monkeypatch: pytest.MonkeyPatch, rate: str) -> None:
    monkeypatch.setenv("TIERGATE_RESPONSE_MIN_READ_BYTES_PER_S", rate)
    with pytest.raises(ValidationError, match="response_min_read_bytes_per_s"):
        Settings()
    with pytest.raises(ValueError, match="least read rate"):
        http_limits.limited_protocol(30, 60, min_read_bytes_per_s=float(rate))
