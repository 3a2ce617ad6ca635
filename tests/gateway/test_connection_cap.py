"""A process keeps at most `max_connections` client connections, closing the one idle longest for a new one
(gateway/connection_cap.py): a client holding idle sockets cannot take the descriptors other tenants need.
Before, at a soft limit of 256, 400 idle sockets from one client left 3 of 4 other tenants' requests dropped
unanswered and a tier marked down (a probe, quoted in the commit that added the cap)."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from gateway import http_limits
from gateway.connection_cap import FD_RESERVE, ConnectionTable, connection_cap, peer
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.held_answer import held_answer
from tests.stubs import ServerThread, StubState

CAP = 16


class Conn:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    def close_for_room(self) -> None:
        self.closed = True

    def answering(self) -> bool:
        return False


def test_the_table_closes_the_connection_idle_longest_and_never_a_busy_one() -> None:
    table = ConnectionTable(3)
    a, b, c, d, e, f = (Conn(n) for n in "abcdef")
    for conn in (a, b, c):
        assert table.opened(conn)
    table.busy(a)  # a request in progress
    table.busy(b)
    table.idle(b)  # b's answer ended: idle again, after c
    assert table.opened(d) and not a.closed and c.closed and not b.closed  # c idle longest
    table.closed(c)
    assert table.opened(e) and b.closed  # then b; a is busy
    table.closed(b)
    table.busy(d)
    table.busy(e)
    assert not table.opened(f)  # nothing idle: the new one is closed itself
    table.closed(f)
    assert (table.open, table.made_room, table.refused) == (3, 2, 1) and not a.closed


def test_the_table_closes_an_unfinished_head_when_none_is_idle_then_an_unfinished_body() -> None:
    table = ConnectionTable(3)
    a, b, c, d, e, f = (Conn(n) for n in "abcdef")
    for conn in (a, b, c):
        assert table.opened(conn)
    table.heading(a)  # a request's first bytes, no more
    table.heading(b)
    assert table.opened(d) and c.closed and not a.closed  # an idle one goes first
    table.closed(c)
    table.busy(d)  # a whole head: its app runs
    assert table.opened(e) and a.closed and not b.closed  # none idle: the head begun first
    table.closed(a)
    table.receiving(b)  # its head came whole, its body has not
    table.busy(e)
    assert table.opened(f) and b.closed and not d.closed and not e.closed  # then the body begun first
    table.closed(b)
    table.busy(f)
    assert not table.opened(Conn("g")) and not any(x.closed for x in (d, e, f))  # whole requests are never closed


def test_a_full_table_makes_room_for_an_address_past_its_share_among_its_own_connections() -> None:
    """A cap of 4, an address's share 2: one address past it makes room only among its own, or is refused; another
    address makes room among the crowded one's first. By age alone, the other address's connection, idle longest,
    was closed for the crowded one's, and a new address's closed it too."""
    table = ConnectionTable(4, share=0.5)
    other, a, b, c, d, e = (Conn(n) for n in "oabcde")
    assert table.opened(other, "10.0.0.2")  # idle longest
    for conn in (a, b, c):
        assert table.opened(conn, "10.0.0.1")  # three of four: past its share, while there was room
    assert table.opened(d, "10.0.0.1") and a.closed and not other.closed  # its own idle longest, not the other's
    table.closed(a)
    table.busy(b)
    table.busy(c)
    table.heading(d)  # a request begun: after every idle one, by age alone
    assert table.opened(e, "10.0.0.3") and d.closed and not other.closed  # within its share: the crowded one's first
    table.closed(d)
    f = Conn("f")
    assert not table.opened(f, "10.0.0.1") and not other.closed  # past its share, none of its own closable: refused
    table.closed(f)
    assert (table.made_room, table.refused, table.refused_for_address) == (2, 1, 1)
    g = Conn("g")
    assert table.opened(g, "10.0.0.4") and other.closed  # the crowded one's all answering: by age alone again


def test_an_address_counts_by_its_host_and_an_ipv6_one_by_its_64() -> None:
    """A host is given a /64 of IPv6 addresses: counted one by one, one client would be 2**64 addresses."""
    assert peer(("203.0.113.7", 5000)) == "203.0.113.7"
    assert peer(("2001:db8:1:2:aaaa::1", 5000)) == peer(("2001:db8:1:2:bbbb::2", 6000)) == "2001:db8:1:2::/64"
    assert peer(("2001:db8:1:3::1", 5000)) != peer(("2001:db8:1:2::1", 5000))
    assert peer(("::ffff:203.0.113.7", 5000)) == "203.0.113.7"  # IPv4 on a dual-stack socket
    assert peer(None) == ""  # a Unix socket's peer: one address


def test_the_cap_stays_below_the_open_file_limit() -> None:
    assert connection_cap(1024, 10_000) == 1024 - FD_RESERVE
    assert connection_cap(256, 10_000) == 128  # at most half the limit kept back
    assert connection_cap(1 << 20, 10_000) == 10_000


def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    """In a process of its own: a soft limit of 128 under a hard one of 256 (a hard limit may only be lowered, and
    every host allows 256) becomes 256."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (128, 256)); "
            "from gateway.connection_cap import raised_fd_limit; print(raised_fd_limit(), "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["256", "256"]


@pytest.fixture
def capped_gateway(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings.model_copy(update={"max_connections": CAP}), stub[1]) as gw:
        yield gw


def _closed_by_peer(sock: socket.socket) -> bool:
    poller = select.poll()  # not select(): it refuses a descriptor past 1,023, which a long test worker can reach
    poller.register(sock, select.POLLIN)
    ready = poller.poll(500)
    return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""


_BODY = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


def _begun(gateway: Gateway, body: bytes) -> socket.socket:
    """A connection with a request's whole head and the start of its body (the rest is the caller's to send), its head
    read by the gateway by the time this returns."""
    url = urlparse(gateway.url)
    busy = socket.create_connection((url.hostname, url.port))
    busy.sendall(_head(gateway.tenant_key, len(body)) + body[:5])
    with gateway.client(gateway.tenant_key) as c:
        assert c.get("/v1/models").status_code == 200  # the busy request's head has been read by now
    return busy


def _five_answered(gateway: Gateway, body: bytes) -> None:
    """Five requests of the tenant's, past the cap, all answered."""
    with gateway.client(gateway.tenant_key) as c:
        for _ in range(5):
            assert c.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}).status_code == 200


def _head(key: str, length: int) -> bytes:
    """A chat request's line and headers, with `key`, for a body of `length` bytes."""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n").encode()


def test_idle_sockets_past_the_cap_leave_other_tenants_served(capped_gateway: Gateway) -> None:
    url = urlparse(capped_gateway.url)
    body = _BODY
    busy = _begun(capped_gateway, body)
    idle = [socket.create_connection((url.hostname, url.port)) for _ in range(3 * CAP)]
    try:
        _five_answered(capped_gateway, body)
        closed = [_closed_by_peer(s) for s in idle]
        assert all(closed[:CAP]) and not all(closed), closed  # the oldest idle ones made room; not every one
        busy.sendall(body[5:])  # the request in progress was never closed for room
        assert busy.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in [*idle, busy]:
            s.close()


def test_request_heads_begun_and_never_finished_past_the_cap_leave_other_tenants_served(
        capped_gateway: Gateway) -> None:
    """A client with no key sends one byte of a request on each of more connections than the cap: the ones whose
    heads began first make room for new ones. They counted as busy, so the cap's worth of them closed every other
    tenant's new connection at once (the tenant's request got a reset) until the request deadline."""
    url = urlparse(capped_gateway.url)
    body = _BODY
    busy = _begun(capped_gateway, body)
    begun = []
    try:
        for _ in range(2 * CAP):
            sock = socket.create_connection((url.hostname, url.port))
            sock.sendall(b"P")
            begun.append(sock)
        _five_answered(capped_gateway, body)
        closed = [_closed_by_peer(s) for s in begun]
        assert all(closed[:CAP]) and not all(closed), closed  # the heads begun first made room
        busy.sendall(body[5:])  # the request whose head was whole was never closed for room
        assert busy.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in [*begun, busy]:
            s.close()


def test_request_bodies_begun_and_never_finished_past_the_cap_leave_other_tenants_served(
        capped_gateway: Gateway) -> None:
    """A tenant sends a whole head with its key and a body that never comes on more connections than the cap: the
    ones whose bodies began first make room for new ones (their requests have spent nothing). They counted as busy,
    so the cap's worth of them closed every other tenant's new connection at once until the request deadline. A
    request that is whole and being answered (a stream) is never closed for room."""
    url = urlparse(capped_gateway.url)
    body = _BODY
    slow = json.dumps({"model": "mid", "stream": True, "max_tokens": 6,
                       "messages": [{"role": "user", "content": "STUB:slow hi"}]}).encode()

    def head(length: int) -> bytes:
        return _head(capped_gateway.tenant_key, length)

    answering = socket.create_connection((url.hostname, url.port))
    answering.sendall(head(len(slow)) + slow)
    answered = answering.recv(65536)
    assert answered.startswith(b"HTTP/1.1 200 ")  # its stream has begun
    begun = []
    try:
        for _ in range(2 * CAP):
            sock = socket.create_connection((url.hostname, url.port))
            sock.sendall(head(1000) + b"{")
            begun.append(sock)
        _five_answered(capped_gateway, body)
        closed = [_closed_by_peer(s) for s in begun]
        assert all(closed[:CAP - 1]) and not all(closed), closed  # the bodies begun first made room
        while b"data: [DONE]" not in answered and (chunk := answering.recv(65536)):
            answered += chunk
        assert b"data: [DONE]" in answered  # the stream was never closed for room
    finally:
        for s in [*begun, answering]:
            s.close()


def test_a_connection_answered_before_its_body_came_is_not_closed_for_room_mid_answer() -> None:
    """A request whose app answers before reading its body (a 401, a route that reads none) stays among the unfinished
    bodies, closable for room, until its body comes: one whose answer had begun (here its first part sent, the rest
    after a wait) was closed as one whose app had spent nothing, its answer cut. Now a connection being answered is
    kept (the new one is refused), as a whole request's is. A real uvicorn server with the gateway's protocol and an
    app whose answer spans an await (in the gateway: a write paused between an answer's start and its body)."""
    release = threading.Event()
    protocol = http_limits.limited_protocol(30, 60, max_connections=1)
    with ServerThread(held_answer(release), http=protocol).start() as server:
        url = urlparse(server.url)
        answered = socket.create_connection((url.hostname, url.port))
        answered.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")  # its body never all comes
        answered.settimeout(10)
        got = b""
        while b"first" not in got and (chunk := answered.recv(65536)):
            got += chunk
        assert got.endswith(b"first"), got  # its answer has begun
        new = socket.create_connection((url.hostname, url.port))  # past the cap of 1
        try:
            refused = _closed_by_peer(new)
            release.set()
            while chunk := answered.recv(65536):
                got += chunk
                if got.endswith(b"first-rest"):
                    break
            assert got.endswith(b"first-rest"), got  # answered whole
            assert refused  # nothing else to close: the new connection is
        finally:
            release.set()
            answered.close()
            new.close()


def _from(gateway_url: str, source: str) -> socket.socket:
    """A connection to the gateway from the loopback address `source` (every 127.x.y.z is this host's)."""
    url = urlparse(gateway_url)
    return socket.create_connection((url.hostname, url.port), source_address=(source, 0))


def _models(sock: socket.socket, key: str) -> bytes:
    """GET /v1/models on `sock`, kept alive: the answer's head and body (b"" if the gateway closed the connection)."""
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    sock.settimeout(10)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while b"\r\n\r\n" not in got and (chunk := sock.recv(65536)):
            got += chunk
        if not got:
            return got
        head, _, body = got.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
        got = head + b"\r\n\r\n" + body
    return got


def test_one_address_opening_past_the_cap_closes_only_its_own_connections(capped_gateway: Gateway) -> None:
    """Another address's four kept-alive connections, idle longest, and one address opening three times the cap of
    sockets that send nothing: its new ones make room among its own (its share, half the cap, passed), so the other
    address's connections serve again. By age alone they were the first closed for its new ones."""
    others = [_from(capped_gateway.url, "127.0.0.2") for _ in range(4)]
    flood: list[socket.socket] = []
    try:
        for sock in others:
            assert _models(sock, capped_gateway.tenant_key).startswith(b"HTTP/1.1 200 ")
        flood += [_from(capped_gateway.url, "127.0.0.1") for _ in range(3 * CAP)]
        _five_answered(capped_gateway, _BODY)  # from 127.0.0.1 too, after every one of them
        assert all(_closed_by_peer(s) for s in flood[:CAP])  # its oldest made room for its newer ones
        for sock in others:
            got = _models(sock, capped_gateway.tenant_key)
            assert got.startswith(b"HTTP/1.1 200 "), got[:200]  # never closed for its connections
    finally:
        for s in [*others, *flood]:
            s.close()


def test_an_address_past_its_share_with_every_connection_answering_is_refused_not_another() -> None:
    """A cap of 4: another address's connection, idle since it opened, and three of one address's being answered
    (their answers held): that address's next connection is closed at once, as the cap closes any (none of its own
    may be closed for it, and it holds more than its share, 2), and the other's connection still serves. By age
    alone the other's was closed for it. A real uvicorn server with the gateway's protocol."""
    release = threading.Event()

    def answer_begun(sock: socket.socket) -> bytes:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        got = b""
        while b"first" not in got and (chunk := sock.recv(65536)):
            got += chunk
        return got

    protocol = http_limits.limited_protocol(30, 60, max_connections=4)
    with ServerThread(held_answer(release), http=protocol).start() as server:
        other = _from(server.url, "127.0.0.2")
        answering = [_from(server.url, "127.0.0.1") for _ in range(3)]
        new = None
        try:
            for sock in answering:
                assert answer_begun(sock).endswith(b"first")
            new = _from(server.url, "127.0.0.1")
            assert _closed_by_peer(new)  # refused
            got = answer_begun(other)
            assert got.endswith(b"first"), got  # the other address's connection was kept
        finally:
            release.set()
            for s in [other, *answering, *([new] if new else [])]:
                s.close()
