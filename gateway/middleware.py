"""Stamps every response with `x-tiergate-request-id` and `x-tiergate-tier` (`none` before routing)."""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send


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


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})  # type: ignore[typeddict-item]
        state["request_id"] = _ids.next()
        state["t0"] = time.perf_counter()

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
            await send(message)

        await app(scope, receive, send_with_ids)

    return middleware
