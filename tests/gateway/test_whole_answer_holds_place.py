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
The hold itself, on the middleware alone: tests/gateway/test_hold_until_sent.py.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import pytest

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
