"""Stamps every response with `x-tiergate-request-id` and `x-tiergate-tier` (`none` before routing), and holds what a
route asked to hold until its answer's body is handed over to the client (`hold_until_sent`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from gateway.pipeline.gate import Pass

PIECE = 64 << 10  # a held answer's body is written in pieces of this size, each once the connection takes more
_HELD = "held_until_sent"  # in the request's state: the passes to let go once its answer's body is handed over
# the longest a held answer's last write waits on the quota store's answer to its slots' release (the store's own call
# timeout ends the wait first: its first try's; a release not landed by then is retried in the background)
RELEASE_WAIT_S = 1.0


class _RequestIds:
    """32 hex digits unique across processes and replicas without a syscall per request (uuid4 reads the
    kernel's random source every time): 16 random digits per process, then the process's request counter
    encrypted under a key of the process's own, so no tenant can count from it the requests of others.

    The 16 digits after the prefix were the counter itself, and in `chatcmpl-…` ids too: a tenant's two ids told
    it how many requests every other tenant had made between them (a competitor's exact request rate). They are
    now a permutation of the counter (a 4-round Feistel network over 64 bits whose round function is keyed
    BLAKE2s, a pseudorandom permutation by Luby and Rackoff): still unique in the process (the ledger's key),
    but ids in no order and no distance from each other; 3-5 us a request. The prefix stays one per process
    (the per-process random part, which tells a tenant which worker answered and nothing of the others' traffic).
    """

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()
        self._rounds: list[Any] = []

    def next(self) -> str:
        if self._pid != os.getpid():  # a forked worker gets its own prefix and key, and starts counting again
            key = secrets.token_bytes(32)
            self._pid, self._prefix, self._counter = os.getpid(), secrets.token_hex(8), itertools.count()
            self._rounds = [hashlib.blake2s(key=key, person=b"tg-rid-" + bytes((i,)), digest_size=4)
                            for i in range(4)]
        return f"{self._prefix}{self._permute(next(self._counter)):016x}"

    def _permute(self, n: int) -> int:
        """`n` (< 2**64) through the Feistel network: a bijection of 64-bit numbers, so distinct counters give
        distinct ids. Each round: (left, right) -> (right, left ^ F_i(right)), F_i keyed BLAKE2s to 32 bits."""
        left, right = n >> 32, n & 0xFFFFFFFF
        for keyed in self._rounds:
            h = keyed.copy()
            h.update(right.to_bytes(4, "little"))
            left, right = right, left ^ int.from_bytes(h.digest(), "little")
        return (left << 32) | right


_ids = _RequestIds()


def hold_until_sent(scope: Scope, entry: Pass) -> None:
    """Keep `entry`'s place in its tenant's gate (gateway/pipeline/gate.py `Pass.hold`) until the request's answer
    has been handed over to its client, not only made: given back just before the last piece of its body is written
    (`_send_last`), or when the request ends however it ends (the client gone or reset, an error, a cancellation).
    An answer is ready, and its request's work over, before its JSON body is written; a whole JSON body is one write
    to the connection, which uvicorn makes at once and keeps in its transport's buffer until the client takes it. So a
    tenant allowed one request at a time whose client read nothing had any number of answers of megabytes held in the
    gateway's memory at once (10 embeddings answers of 16.6 MB each; 50 replays of a stored answer, free of tokens,
    800 MB), each until its connection was reset as stalled (gateway/http_limits.py, `stall_s`). Held, the body
    waits on its client in pieces, within the write-pause budget that cuts a client reading too slowly, and the
    tenant's next request past its concurrency is refused 429. Nothing is held where this middleware does not run (an
    app built without it): the place is then given back when the request path leaves it, as before.

    Held under the request's id, the pass keeps the quota store's concurrency slots its request reserves too
    (gateway/pipeline/reserve.py, `Pass.keeps`): freed as the place is, not at the settle, before the body is written,
    so the limit holds across the replicas that share the store (Redis), not only on this one. A store that does not
    free it at once (Redis) is told in a task begun as the place is given back, and the last piece of the body (a
    stream's, each frame written once its work has ended: its `[DONE]`) is written once the store has answered, within
    its call timeout (at most RELEASE_WAIT_S): a client that sends its next request as soon as it has its answer,
    through another replica, finds the slot free. A request that ends otherwise (an error, a cancellation) waits on
    nothing: its slots' release is begun, and lands when it lands; the 499 a route writes for a client gone is an
    answer like any other, and waits as one."""
    state = scope.get("state", {})
    held = state.get(_HELD)
    if held is not None:
        entry.hold(state.get("request_id"))
        held.append(entry)


def _let_go(held: list[Pass]) -> list[asyncio.Future[None]]:
    """Each hold let go once (one that raises leaves the rest to the middleware's `finally`); the releases of their
    quota slots that the store has not answered yet (`Pass.releasing`)."""
    releasing: list[asyncio.Future[None]] = []
    while held:
        entry = held.pop()
        entry.let_go()
        releasing += entry.releasing()
    return releasing


async def _released(releasing: list[asyncio.Future[None]]) -> None:
    """Wait until the store has answered `releasing` (whatever it said: one it failed is retried in the background,
    logged by its FaultLog), at most RELEASE_WAIT_S; none cancelled."""
    if releasing:
        await asyncio.wait(releasing, timeout=RELEASE_WAIT_S)


async def _send_last(send: Send, message: Message, held: list[Pass]) -> None:
    """A held answer's last body message: all of it but its last piece written, a piece at a time (uvicorn's send
    waits while the connection's writes are paused, that is while its transport holds more than its high-water mark,
    and writes once the client has taken enough), then a wait for the client to take those too (an empty write, which
    waits as any does), then the holds let go, a wait for the quota store to answer the releases of the request's
    slots that this began (Redis: within its call timeout, at most RELEASE_WAIT_S), and the last piece written. So the
    place is given back while at most a piece and what the sockets hold are left to read, and the slots freed for
    every replica, before the client can have read its whole answer: a client that sends its next request as soon as
    the last one is read, to this replica or another, is never refused for the last one (unless the store did not
    answer in time: then the slot is freed in the background, or by its lease). A client that leaves or is reset
    (gateway/http_limits.py) ends the waits but the store's, and the writes after them write nothing. A body of one
    piece (most answers) is let go and written once the store has answered: there is nothing of it before its last
    piece to wait on."""
    body = message.get("body", b"")
    if len(body) <= PIECE:
        await _released(_let_go(held))
        await send(message)
        return
    view = memoryview(body)
    last = (len(view) - 1) // PIECE * PIECE  # where the last piece begins
    for at in range(0, last, PIECE):
        await send({"type": "http.response.body", "body": view[at:at + PIECE], "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": True})
    await _released(_let_go(held))
    await send({**message, "body": view[last:]})  # type: ignore[typeddict-item]


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})  # type: ignore[typeddict-item]
        state["request_id"] = _ids.next()
        state["t0"] = time.perf_counter()
        held: list[Pass] = []
        state[_HELD] = held

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                headers.append((b"x-tiergate-request-id", state["request_id"].encode()))
                if b"x-tiergate-tier" not in names:
                    headers.append((b"x-tiergate-tier", str(state.get("tier") or "none").encode()))
                ladder = getattr(getattr(scope["app"].state, "services", None), "ladder", None)  # type: ignore[index]
                if ladder is not None:
                    headers.append((b"x-tiergate-degrade-level", str(ladder.level).encode()))
                message["headers"] = headers
            elif held and message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    await _send_last(send, message, held)
                    return
                for entry in held:  # a stream's place, freed as its work ended: its last frames wait on the store too
                    if releasing := entry.releasing():
                        await _released(releasing)
            await send(message)

        try:
            await app(scope, receive, send_with_ids)
        finally:  # the request over, its answer sent or not: what is still held is let go
            _let_go(held)

    return middleware
