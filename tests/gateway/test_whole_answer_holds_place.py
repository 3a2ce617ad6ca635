"""A request's place in its tenant's concurrency is held until its answer's body is handed over to the client, or the
client is gone (gateway/middleware.py `hold_until_sent`), not only until the answer is made.

The place was given back as soon as the answer was ready, before a byte of a JSON body was written, and the body was
one write that uvicorn makes at once and keeps until the client takes it: a tenant allowed one request at a time
whose client read none of its answers had any number of them held in the gateway's memory (10 embeddings answers of
16.6 MB, 50 replays of a stored answer, free of tokens, 800 MB), each until its connection was reset as stalled, a
minute later. Here a client with a small receive buffer reads the head of a large answer and stops: the tenant's
next request is refused 429 (its concurrency) while that answer waits, and admitted once the client resets the
connection mid-body. Whole chat and text-completion answers, embeddings, Idempotency-Key replays and cache hits alike;
a stream held its place already (its frames are written one at a time, each waiting on the client) and still does.
A client that reads its answer and sends the next request at once is not refused for the last one. The quota store's
concurrency slot is held as long and freed once (tests/gateway/test_quota_slot_held_until_sent.py: across replicas).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest

from gateway import middleware
from gateway.middleware import PIECE, hold_until_sent, request_id_middleware
from gateway.pipeline.gate import TenantGate, scopes_of
from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from quotas.plans import Limits
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState, _sse, stub_app

WAIT_S = 10.0
SEND_BUFFER = 16 << 10  # the gateway's send buffers, fixed (Linux grows one to megabytes else)
RECEIVE_BUFFER = 4 << 10  # the client's that reads nothing
MODEL = "all-MiniLM-L6-v2"
BIG_CHAT = {"model": "mid", "messages": [{"role": "user", "content": "STUB:big"}], "max_tokens": 400,
            "temperature": 0}  # 400 pieces of 1,000 characters: about 400 KB
BIG_TEXT = {"model": "mid", "prompt": "STUB:big", "max_tokens": 400, "temperature": 0}
BIG_EMBEDDINGS = {"model": MODEL, "input": [f"text {i}" for i in range(64)]}  # 64 vectors as JSON: about 500 KB
EVERY_ROUTE = pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", BIG_CHAT), ("/v1/completions", BIG_TEXT),
                       ("/v1/embeddings", BIG_EMBEDDINGS)], ids=["chat", "completions", "embeddings"])
REPLAY = "x-tiergate-idempotent-replay"


def big_completions(state: StubState, inner: Any) -> Any:
    """The stub upstream, whose text completions are `STUB:big`'s pieces of 1,000 characters, as many as
    `max_tokens` (its own continue a short text)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await inner(scope, receive, send)
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        state.requests.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for chunk in _sse(state, body, ["y" * 1_000] * body["max_tokens"], 2, 0.0, die=False, legacy=True,
                                whole=50_000):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


@pytest.fixture
def stub() -> Iterator[tuple[ServerThread, StubState]]:
    state = StubState()
    server = ServerThread(big_completions(state, stub_app(state))).start()
    yield server, state
    server.stop()


@pytest.fixture
def gateway(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1], send_buffer=SEND_BUFFER) as gw:
        yield gw


def one_at_a_time(gw: Gateway) -> tuple[str, str]:
    """A key of `acme` allowed one request at a time: its scope and its secret."""
    key, secret = gw.store.issue_key("acme", name="one-at-a-time", limits=Limits(max_concurrent=1))
    return f"acme/k:{key.key_id}", secret


def in_flight(gw: Gateway, scope: str) -> int:
    return gw.app.state.services.pipeline.gate.in_flight(scope)


def wait_for(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def unread(gw: Gateway, path: str, secret: str, body: dict[str, Any], headers: dict[str, str] | None = None
           ) -> tuple[socket.socket, bytes]:
    """A request whose client reads its answer's head and nothing more: the socket, still open, and the head."""
    url = urlparse(gw.url)
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)  # before connecting: the window it offers
    sock.connect((url.hostname, url.port))
    sock.settimeout(WAIT_S)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {url.netloc}\r\nauthorization: Bearer {secret}\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n{extra}\r\n".encode() + payload)
    head = b""
    while b"\r\n\r\n" not in head:
        got = sock.recv(1)  # a byte at a time: not one of the body's taken
        assert got, head
        head += got
    return sock, head.lower()


def reset(sock: socket.socket) -> None:
    """Closed with a reset, its answer unread: the client gone mid-body."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def request_id(head: bytes) -> str:
    """The request's id, from its answer's head (lower-cased)."""
    line = next(line for line in head.split(b"\r\n") if line.startswith(b"x-tiergate-request-id:"))
    return line.split(b":", 1)[1].strip().decode()


@contextmanager
def counted_releases(gw: Gateway) -> Iterator[list[str]]:
    """The request ids whose kept quota slots the gateway's store has freed (`QuotaBackend.release`), each appended
    once its release has run."""
    backend = gw.app.state.services.pipeline.reserve.quotas.backend
    calls: list[str] = []
    # (none on a store from before kept slots, whose settle freed the slot: then nothing is counted)
    release, release_now = getattr(type(backend), "release", None), getattr(type(backend), "release_now", None)

    async def counted(req: Any) -> None:
        assert release is not None
        await release(backend, req)
        calls.append(req.request_id)

    def counted_now(req: Any) -> None:
        assert release_now is not None
        release_now(backend, req)
        calls.append(req.request_id)

    backend.release, backend.release_now = counted, counted_now
    try:
        yield calls
    finally:
        del backend.release, backend.release_now


def store_slots(gw: Gateway, scope: str) -> int:
    """The concurrency slots the embedded quota store holds for `scope` ("<tenant>/k:<id>")."""
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    tenant, key = scope.split("/")
    state = backend._state.get((tenant, key))
    return 0 if state is None else len(state.inflight)


def assert_held_then_freed(gw: Gateway, scope: str, secret: str, sock: socket.socket, head: bytes) -> None:
    """While `sock`'s answer waits unread, the key's next request is refused for its concurrency, and the quota
    store still holds the first's slot; once the client resets the connection, its place is given back and its slot
    freed (once each: the next is admitted, and then none is left held)."""
    rid = request_id(head)
    with counted_releases(gw) as releases:
        try:
            assert head.startswith(b"http/1.1 200"), head
            with gw.client(secret) as c:
                refused = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
            # before the fix: 200, the first request's place given back before its body was written
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_concurrency", refused.text
            assert in_flight(gw, scope) == 1
            # the store's slot too (Redis' is every replica's): before, its settle freed it before the body was written
            assert store_slots(gw, scope) == 1 and releases == []
        finally:
            reset(sock)
        wait_for(lambda: in_flight(gw, scope) == 0, "the place of a request whose client reset it was never given back")
        wait_for(lambda: rid in releases, "the store's slot of a request whose client reset it was never freed")
        assert store_slots(gw, scope) == 0
        assert releases.count(rid) == 1 and len(set(releases)) == len(releases), releases  # each slot freed once
    with gw.client(secret) as c:
        assert c.post("/v1/chat/completions", json=BIG_CHAT).status_code == 200  # read whole: admitted
        # read whole, and the next sent at once: never refused for the one before
        assert c.post("/v1/embeddings", json=BIG_EMBEDDINGS).status_code == 200
        assert c.post("/v1/completions", json=BIG_TEXT).status_code == 200
    wait_for(lambda: in_flight(gw, scope) == 0, "a place was left held")


@EVERY_ROUTE
def test_an_unread_answer_holds_its_place_until_its_client_resets(gateway: Gateway, path: str,
                                                                  body: dict[str, Any]) -> None:
    scope, secret = one_at_a_time(gateway)
    sock, head = unread(gateway, path, secret, body)
    assert_held_then_freed(gateway, scope, secret, sock, head)


@EVERY_ROUTE
def test_an_unread_replay_of_a_stored_answer_holds_its_place(gateway: Gateway, path: str,
                                                             body: dict[str, Any]) -> None:
    """A replay costs no tokens: before, a tenant allowed one request at a time had 50 replays of megabytes unread."""
    scope, secret = one_at_a_time(gateway)
    key = {"idempotency-key": f"held-{path}"}
    with gateway.client(secret) as c:
        assert c.post(path, json=body, headers=key).status_code == 200  # answered and stored
    sock, head = unread(gateway, path, secret, body, key)
    assert f"{REPLAY}: true".encode() in head, head
    assert_held_then_freed(gateway, scope, secret, sock, head)


def test_an_unread_cache_hit_holds_its_place(gateway: Gateway) -> None:
    scope, secret = one_at_a_time(gateway)
    with gateway.client(secret) as c:  # answered, then asked again until the cache has it (its store is off the path)
        wait_for(lambda: c.post("/v1/chat/completions", json=BIG_CHAT).headers.get("x-tiergate-cache") == "hit",
                 "the answer was never cached")
    sock, head = unread(gateway, "/v1/chat/completions", secret, BIG_CHAT)
    assert b"x-tiergate-cache: hit" in head, head
    assert_held_then_freed(gateway, scope, secret, sock, head)


def test_an_unread_stream_holds_its_place_as_before(gateway: Gateway) -> None:
    scope, secret = one_at_a_time(gateway)
    sock, head = unread(gateway, "/v1/chat/completions", secret, {**BIG_CHAT, "stream": True})
    assert b"text/event-stream" in head, head
    assert_held_then_freed(gateway, scope, secret, sock, head)


# the hold itself, on the middleware alone: given back once, whatever ends the request


class Client:
    """An ASGI server's `send` whose client takes what is written when told (`take`), recording each write with
    the gate's count at the moment it was asked."""

    def __init__(self, gate: TenantGate) -> None:
        self.gate = gate
        self.writes: list[tuple[int, int, bool]] = []  # (bytes, places held when written, more_body)
        self.reading = asyncio.Event()
        self.reading.set()

    async def send(self, message: dict[str, Any]) -> None:
        await self.reading.wait()  # uvicorn's send waits while the connection's writes are paused
        if message["type"] == "http.response.body":
            self.writes.append((len(message["body"]), self.gate.in_flight("acme"), message.get("more_body", False)))


def held_app(gate: TenantGate, body: bytes, fail: BaseException | None = None, release: Any = None) -> Any:
    """A route as answering.py's: admitted, the place held until sent, the request path leaving it as it ends;
    `release`: what frees the quota store's slot its request reserved, kept with its place (reserve.py `_keep_slot`)."""
    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        entry = gate.enter(scopes_of("acme", "k1", Limits(max_concurrent=2), None))
        hold_until_sent(scope, entry)  # type: ignore[arg-type]
        if release is not None:
            assert entry.keeps(release)
        entry.leave()  # the answer made: the path over
        if fail is not None:
            raise fail
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return request_id_middleware(route)


async def noop_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


def scope() -> dict[str, Any]:
    return {"type": "http", "app": SimpleNamespace(state=SimpleNamespace()), "state": {}}  # an app with no ladder


def test_a_held_body_is_sent_in_pieces_and_its_place_given_back_before_the_last() -> None:
    gate = TenantGate()
    client = Client(gate)
    body = b"x" * (3 * PIECE + 5)
    asyncio.run(held_app(gate, body)(scope(), noop_receive, client.send))
    assert b"".join(b"x" * n for n, _, _ in client.writes) == body
    assert [n for n, _, _ in client.writes] == [PIECE, PIECE, PIECE, 0, 5]
    assert [held for _, held, _ in client.writes] == [1, 1, 1, 1, 0]  # given back before the last piece only
    assert [more for _, _, more in client.writes] == [True, True, True, True, False]
    assert gate.in_flight("acme") == 0


def test_a_small_body_is_one_write_after_the_place_is_given_back() -> None:
    gate = TenantGate()
    client = Client(gate)
    asyncio.run(held_app(gate, b"{}")(scope(), noop_receive, client.send))
    assert client.writes == [(2, 0, False)]  # one piece: nothing before it to wait on, so no empty write either


@pytest.mark.parametrize("fail", [RuntimeError("a bug"), asyncio.CancelledError()])
def test_a_request_that_fails_before_its_answer_gives_its_place_back_once(fail: BaseException) -> None:
    gate = TenantGate()
    other = gate.enter(scopes_of("acme", "k2", Limits(max_concurrent=2), None))  # another request, still running
    with pytest.raises(type(fail)):
        asyncio.run(held_app(gate, b"{}", fail)(scope(), noop_receive, Client(gate).send))
    assert gate.in_flight("acme") == 1  # its own place only: once
    other.leave()
    assert gate.in_flight("acme") == 0


def test_a_request_cancelled_while_its_body_waits_on_the_client_gives_its_place_back() -> None:
    gate = TenantGate()
    client = Client(gate)

    async def run() -> None:
        client.reading.clear()  # the client reads nothing: the writes wait
        task = asyncio.create_task(held_app(gate, b"x" * (4 * PIECE))(scope(), noop_receive, client.send))
        for _ in range(10):
            await asyncio.sleep(0)
        assert gate.in_flight("acme") == 1 and not task.done()  # held while its answer waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert gate.in_flight("acme") == 0


def test_the_place_is_freed_when_both_the_path_and_the_hold_let_go_in_either_order() -> None:
    gate = TenantGate()
    scopes = scopes_of("acme", "k1", Limits(max_concurrent=1), None)
    for path_first in (True, False):
        entry = gate.enter(scopes)
        entry.hold()
        first, second = (entry.leave, entry.let_go) if path_first else (entry.let_go, entry.leave)
        first()
        first()  # twice: still held by the other
        assert gate.in_flight("acme") == 1
        second()
        second()
        assert gate.in_flight("acme") == 0  # freed once



@pytest.mark.parametrize("path_first", [True, False])
def test_the_quota_slots_a_held_pass_keeps_are_freed_once_with_its_places(path_first: bool) -> None:
    """What frees the store's slots of the request (gateway/pipeline/reserve.py `_keep_slot`) is called once, when the
    places are freed, whichever of the path and the hold lets go last, and even where another such call raises."""
    gate = TenantGate()
    freed: list[str] = []

    def broken() -> None:
        freed.append("broken")
        raise RuntimeError("a bug")

    entry = gate.enter(scopes_of("acme", "k1", Limits(max_concurrent=1), None))
    entry.hold("r1")
    assert gate.held("r1") is entry
    assert entry.keeps(lambda: freed.append("floor")) and entry.keeps(broken)
    assert entry.keeps(lambda: freed.append("exact"))
    first, second = (entry.leave, entry.let_go) if path_first else (entry.let_go, entry.leave)
    first()
    assert freed == [] and gate.held("r1") is entry  # still held by the other
    second()
    second()
    assert sorted(freed) == ["broken", "exact", "floor"]  # each once, the one after a failure too
    assert gate.held("r1") is None and gate.in_flight("acme") == 0
    assert not entry.keeps(lambda: freed.append("late"))  # free already: the caller frees its slot itself


# the quota store's slots, kept with the place: a store that frees them in a task (Redis) has freed them before the
# last piece is written, so a client that sends its next request at once, through any replica, is not refused


class Release:
    """What frees a kept quota slot in a store that does not free it at once (quotas/reservations.py
    `release_slot`): each call begins a release, done once the store answers (`land`)."""

    def __init__(self) -> None:
        self.begun: list[asyncio.Future[None]] = []

    def __call__(self) -> asyncio.Future[None]:
        self.begun.append(asyncio.get_running_loop().create_future())
        return self.begun[-1]

    def landed(self) -> bool:
        return bool(self.begun) and all(f.done() for f in self.begun)

    async def land(self, turns: int = 5) -> None:
        """The store answers the release some turns of the event loop after it is begun."""
        while not self.begun:
            await asyncio.sleep(0)
        for _ in range(turns):
            await asyncio.sleep(0)
        self.begun[0].set_result(None)


class StoreClient(Client):
    """A `Client` that records, with each body write, whether the release of the request's slot had landed."""

    def __init__(self, gate: TenantGate, release: Release) -> None:
        super().__init__(gate)
        self.release = release
        self.landed: list[bool] = []

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        if message["type"] == "http.response.body":
            self.landed.append(self.release.landed())


@pytest.mark.parametrize("size", [2, 3 * PIECE + 5], ids=["one-piece", "many-pieces"])
def test_the_last_piece_is_written_once_the_store_has_freed_the_slot(size: int) -> None:
    """Before: the release was begun as the place was given back and the last piece written at once, before it had
    landed: the client, its answer whole, was refused its next request by another replica."""
    gate, release = TenantGate(), Release()
    client = StoreClient(gate, release)

    async def run() -> None:
        lander = asyncio.create_task(release.land())
        await held_app(gate, b"x" * size, release=release)(scope(), noop_receive, client.send)
        await lander

    asyncio.run(run())
    assert client.landed[-1] and not any(client.landed[:-1]), client.landed  # the last write only, and after it
    assert len(release.begun) == 1 and gate.in_flight("acme") == 0


def test_a_store_that_does_not_answer_delays_the_last_piece_no_longer_than_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(middleware, "RELEASE_WAIT_S", 0.01)
    gate, release = TenantGate(), Release()
    client = StoreClient(gate, release)
    asyncio.run(held_app(gate, b"x" * (2 * PIECE), release=release)(scope(), noop_receive, client.send))
    assert [n for n, _, _ in client.writes] == [PIECE, 0, PIECE]  # written whole all the same
    assert len(release.begun) == 1 and not release.landed()  # (its background retries, or its lease, free it)


@pytest.mark.parametrize("fail", [RuntimeError("a bug"), asyncio.CancelledError()])
def test_a_request_that_ends_otherwise_waits_on_no_release(fail: BaseException) -> None:
    """The client gone, an error, a cancellation: the release is begun and the request ends, without a wait."""
    gate, release = TenantGate(), Release()

    async def run() -> None:
        task = asyncio.create_task(held_app(gate, b"{}", fail, release=release)(scope(), noop_receive,
                                                                                Client(gate).send))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.done()  # (a wait on the release would hold it until RELEASE_WAIT_S)
        with pytest.raises(type(fail)):
            await task

    asyncio.run(run())
    assert len(release.begun) == 1 and not release.landed() and gate.in_flight("acme") == 0


def test_a_streams_last_frames_are_written_once_the_store_has_freed_the_slot() -> None:
    """A stream's place is its pipeline's, given back as its work ends, before its `[DONE]` is written
    (gateway/routes/chat.py `_sse`): the frames after wait on the store's answer too."""
    gate, release = TenantGate(), Release()
    client = StoreClient(gate, release)

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        entry = gate.enter(scopes_of("acme", "k1", Limits(max_concurrent=2), None))
        hold_until_sent(scope, entry)  # type: ignore[arg-type]
        assert entry.keeps(release)
        entry.let_go()  # a stream's place is its pipeline's (gateway/routes/answering.py)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        entry.leave()  # its work over
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def run() -> None:
        lander = asyncio.create_task(release.land())
        await request_id_middleware(route)(scope(), noop_receive, client.send)
        await lander

    asyncio.run(run())
    assert client.landed == [False, True, True]  # its [DONE] once the slot is free
