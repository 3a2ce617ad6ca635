"""An embeddings answer kept under its Idempotency-Key is packed (`pack_vectors`, about 20 ms for the largest) in a
worker thread, never on the event loop; and a client that leaves while it is packed settles its request once, as one
that leaves earlier: one row, `cancelled`, 499, billed for the vectors made, its answer not stored and its key given
up (a retry runs, then replays)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gateway.embedding_bodies as embedding_bodies
from gateway.embeddings_service import EmbeddingsService
from tests.conftest import Gateway
from tests.gateway.embeddings_leaving import rows_not_ok, send_and_leave

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"sentence number {i} about rivers, mountains and the sea" for i in range(8)]
REPLAY = "x-tiergate-idempotent-replay"


class Packs:
    """`pack_vectors`, recorded: whether each call ran on an event loop's thread; with `hold`, each call waits (up to
    `hold_s`) until `release` is set, once `begun` says it started."""

    def __init__(self, *, hold: bool = False, hold_s: float = 5.0) -> None:
        self.real = embedding_bodies.pack_vectors
        self.on_loop: list[bool] = []
        self.hold, self.hold_s = hold, hold_s
        self.begun = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()

    def __call__(self, vectors: np.ndarray) -> str:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            self.on_loop.append(False)
        self.begun.set()
        if self.hold:
            self.release.wait(self.hold_s)
        try:
            return self.real(vectors)
        finally:
            self.done.set()


@pytest.fixture
def svc(gateway: Gateway) -> EmbeddingsService:
    """The gateway's embeddings service, built by a first request (the first ledger row, `ok`)."""
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    return gateway.app.state.embeddings


@pytest.fixture
def settles(svc: EmbeddingsService, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The status of each settlement the service makes from now on."""
    seen: list[str] = []
    real = svc._settle

    async def settle(*args: Any, **kwargs: Any) -> None:
        seen.append(args[3])  # ctx, reservation, tokens, status, ...
        await real(*args, **kwargs)

    monkeypatch.setattr(svc, "_settle", settle)
    return seen


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[Packs]:
    packs = Packs(hold=True)
    monkeypatch.setattr(embedding_bodies, "pack_vectors", packs)
    yield packs
    packs.release.set()


def test_an_answer_is_packed_off_the_event_loop(gateway: Gateway, svc: EmbeddingsService,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    packs = Packs()
    monkeypatch.setattr(embedding_bodies, "pack_vectors", packs)
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}, headers={"Idempotency-Key": "p-1"})
        again = c.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}, headers={"Idempotency-Key": "p-1"})
    assert first.status_code == 200 and again.headers[REPLAY] == "true"  # packed, stored, replayed
    assert again.json()["data"] == first.json()["data"]
    assert packs.on_loop == [False]  # once, in a thread with no event loop


def test_a_client_that_leaves_during_the_pack_settles_once_and_gives_its_key_up(
        gateway: Gateway, svc: EmbeddingsService, settles: list[str], held: Packs) -> None:
    body = {"model": MODEL, "input": TEXTS}
    send_and_leave(gateway, body, {"Idempotency-Key": "leave-in-pack"}, held.begun.is_set, "its pack")
    rows = rows_not_ok(gateway)  # written while the pack is still held in its thread
    assert not held.done.is_set(), "the pack ended before the client's leaving was noticed"
    assert [(r.tier, r.status, r.http_status) for r in rows] == [("embeddings", "cancelled", 499)], rows
    assert rows[0].input_tokens == sum(svc._num_tokens(TEXTS))  # every vector was made: billed for all of them
    assert settles == ["cancelled"]

    held.release.set()  # the pack under way ends in its thread; its text is not used
    assert held.done.wait(10)
    time.sleep(0.5)
    assert settles == ["cancelled"]  # settled once
    assert sorted(r.status for r in gateway.ledger_rows()) == ["cancelled", "ok"]  # the leaver, the warm-up

    # its answer was not stored and the key was given up: a retry runs (billed in full), then replays
    held.hold = False
    with gateway.client(gateway.tenant_key) as c:
        retry = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-in-pack"})
        again = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-in-pack"})
    assert retry.status_code == 200 and REPLAY not in retry.headers, retry.text
    assert again.headers[REPLAY] == "true" and again.json()["data"] == retry.json()["data"]
    assert settles == ["cancelled", "ok"]
    assert sorted(r.status for r in gateway.ledger_rows()) == ["cancelled", "ok", "ok"]
