"""The hold of a request's place until its answer is sent (gateway/middleware.py `hold_until_sent`), on the middleware
and the gate alone, without a gateway: a whole body is written in pieces of PIECE bytes and the place given back
before the last one only; given back once, whatever ends the request (an error, a cancellation, the client gone while
the body waits), whichever of the request path and the hold lets go last. The quota store's slots kept with the place
are freed once with it, and the last piece (a stream's frames after its place is given back) is written once the
store has freed them, so a client that sends its next request at once, through any replica, is not refused; a store
that does not answer delays it no longer than RELEASE_WAIT_S. Through a whole gateway:
tests/gateway/test_whole_answer_holds_place.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway import middleware
from gateway.middleware import PIECE, hold_until_sent, request_id_middleware
from gateway.pipeline.gate import TenantGate, scopes_of
from quotas.plans import Limits


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
