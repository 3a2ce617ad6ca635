"""An embeddings answer's body (2,048 vectors: about 16.6 MB of JSON, some 100 ms of building and encoding) is built and
JSON-encoded in the counting threads, tenants in turn, fresh or replayed under its Idempotency-Key (the replay's
unpack too), never on the event loop: one tenant replaying a large answer stalled every tenant's requests. The bytes
are those Litestar wrote for the answer's dict before, and a client that leaves while its body is built settles once."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from litestar import Response
from litestar.enums import MediaType

import gateway.embedding_bodies as embedding_bodies
import wire.embeddings as wire_embeddings
from gateway.embeddings_service import EmbeddingsService
from tests.conftest import Gateway
from tests.gateway.embeddings_leaving import rows_not_ok, send_and_leave
from wire.embeddings import embedding_list

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"sentence number {i} about rivers, mountains and the sea" for i in range(19)]  # over a piece of rows
REPLAY = "x-tiergate-idempotent-replay"
COUNTING = "tiergate-count"  # the counting threads' name prefix (gateway/pipeline/prompt.py)


def as_litestar_sent(answer: dict[str, Any]) -> bytes:
    """The bytes Litestar writes for a JSON response holding `answer` (what the route returned before)."""
    return Response(answer).render(answer, MediaType.JSON)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize(("pieces", "more"), [(0, 1), (1, -1), (1, 0), (1, 1), (3, 5)])
def test_the_body_is_what_litestar_wrote_for_the_answer(encoding_format: str, pieces: int, more: int) -> None:
    """Built a piece of rows at a time: every boundary between pieces, and the pieces' own `index`es."""
    rows = wire_embeddings.PIECE_ROWS * pieces + more
    vectors = np.random.default_rng(rows).standard_normal((rows, 384)).astype(np.float32)
    vectors[0, :6] = [0.0, -0.0, 1e-45, -3.4e38, 1e-5, 0.1]  # a denormal, extremes, exponents, a zero's sign
    answer = embedding_list(vectors, model='m "quoted" \u00e9', prompt_tokens=rows * 7,
                            encoding_format=encoding_format)
    body = wire_embeddings.embedding_body(vectors, model='m "quoted" \u00e9', prompt_tokens=rows * 7,
                          encoding_format=encoding_format)
    assert body == as_litestar_sent(answer)
    assert [d["index"] for d in json.loads(body)["data"]] == list(range(rows))


class Calls:
    """Where each call of some function ran: (on an event loop's thread, the thread's name)."""

    def __init__(self, real: Callable[..., Any], *, when: Callable[[Any], bool] = lambda _: True) -> None:
        self.real, self.when = real, when
        self.seen: list[tuple[bool, str]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.real(*args, **kwargs)
        if self.when(out):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:  # no loop runs in this thread
                on_loop = False
            self.seen.append((on_loop, threading.current_thread().name))
        return out

    def off_loop(self) -> bool:
        """Called, and only in the counting threads."""
        return bool(self.seen) and all(not on and name.startswith(COUNTING) for on, name in self.seen)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, Calls]:
    """Every JSON encoding of an embeddings answer (its whole, or a piece of its `data`), every row's base64, and
    every unpack of a stored answer, with the thread each ran in."""
    calls = {"encode": Calls(msgspec.json.encode, when=lambda out: b'"object":"embedding"' in out),
             "b64": Calls(base64.b64encode, when=lambda out: len(out) == 2048),  # a vector's (1,536 bytes)
             "unpack": Calls(embedding_bodies.unpack_vectors)}
    monkeypatch.setattr(msgspec.json, "encode", calls["encode"])  # Litestar's `encode_json` calls it by this name
    monkeypatch.setattr(base64, "b64encode", calls["b64"])
    monkeypatch.setattr(embedding_bodies, "unpack_vectors", calls["unpack"])
    return calls


def check_sent(r: Any, encoding_format: str) -> None:
    """`r`'s body is byte for byte what Litestar wrote for its answer before, with the same content type."""
    answer = r.json()
    if encoding_format == "float":
        vectors = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)  # the floats are float32's
    else:
        vectors = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer["data"]])
    assert r.headers["content-type"] == "application/json"
    assert r.content == as_litestar_sent(embedding_list(vectors, model=answer["model"],
                                                        prompt_tokens=answer["usage"]["prompt_tokens"],
                                                        encoding_format=encoding_format))


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_a_fresh_answer_is_built_and_encoded_in_the_counting_threads(
        gateway: Gateway, recorded: dict[str, Calls], encoding_format: str) -> None:
    body = {"model": MODEL, "input": TEXTS, "encoding_format": encoding_format}
    with gateway.client(gateway.tenant_key) as c:
        plain = c.post("/v1/embeddings", json=body)
        kept = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": f"fresh-{encoding_format}"})
    assert plain.status_code == kept.status_code == 200 and REPLAY not in kept.headers, kept.text
    assert recorded["encode"].off_loop(), recorded["encode"].seen
    if encoding_format == "base64":
        assert recorded["b64"].off_loop(), recorded["b64"].seen
    for r in (plain, kept):
        check_sent(r, encoding_format)  # (its own encoding, in this thread, is recorded too: checked last)
        assert len(r.json()["data"]) == len(TEXTS)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_a_replay_is_unpacked_built_and_encoded_in_the_counting_threads(
        gateway: Gateway, recorded: dict[str, Calls], encoding_format: str) -> None:
    body = {"model": MODEL, "input": TEXTS, "encoding_format": encoding_format}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": f"replay-{encoding_format}"})
        for calls in recorded.values():
            calls.seen.clear()  # the replay's alone
        again = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": f"replay-{encoding_format}"})
    assert first.status_code == 200 and again.headers[REPLAY] == "true", again.text
    assert recorded["unpack"].off_loop() and len(recorded["unpack"].seen) == 1, recorded["unpack"].seen
    assert recorded["encode"].off_loop(), recorded["encode"].seen
    if encoding_format == "base64":
        assert recorded["b64"].off_loop(), recorded["b64"].seen
    assert again.content == first.content
    check_sent(again, encoding_format)  # (its own encoding, in this thread, is recorded too: checked last)


class Held:
    """`embedding_body`, held in its thread (up to `hold_s`) until `release` is set, once `begun` says it started."""

    def __init__(self, hold_s: float = 5.0) -> None:
        self.real = embedding_bodies.embedding_body
        self.hold_s = hold_s
        self.begun, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> bytes:
        self.begun.set()
        self.release.wait(self.hold_s)
        try:
            return self.real(*args, **kwargs)
        finally:
            self.done.set()


@pytest.fixture
def held(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EmbeddingsService, Held, list[str]]]:
    """The gateway's service (built by a first request: an `ok` row), its builds held, and the status of each
    settlement it makes from then on."""
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    svc: EmbeddingsService = gateway.app.state.embeddings
    builds = Held()
    monkeypatch.setattr(embedding_bodies, "embedding_body", builds)
    settles: list[str] = []
    real = svc._settle

    async def settle(*args: Any, **kwargs: Any) -> None:
        settles.append(args[3])  # ctx, reservation, tokens, status, ...
        await real(*args, **kwargs)

    monkeypatch.setattr(svc, "_settle", settle)
    yield svc, builds, settles
    builds.release.set()


def test_a_client_that_leaves_while_its_body_is_built_settles_once(
        gateway: Gateway, held: tuple[EmbeddingsService, Held, list[str]]) -> None:
    """As one that leaves while its answer is packed (test_embeddings_pack_off_loop.py): `cancelled`, 499, billed
    for the vectors made (all of them), written once."""
    svc, builds, settles = held
    send_and_leave(gateway, {"model": MODEL, "input": TEXTS}, {}, builds.begun.is_set, "its body's build")
    rows = rows_not_ok(gateway)  # written while the build is still held in its thread
    assert not builds.done.is_set(), "the build ended before the client's leaving was noticed"
    assert [(r.tier, r.status, r.http_status) for r in rows] == [("embeddings", "cancelled", 499)], rows
    assert rows[0].input_tokens == sum(svc._num_tokens(TEXTS))
    builds.release.set()  # the build under way ends in its thread; its bytes are not used
    assert builds.done.wait(10)
    time.sleep(0.5)
    assert settles == ["cancelled"]
    assert sorted(r.status for r in gateway.ledger_rows()) == ["cancelled", "ok"]  # the leaver, the warm-up


def test_a_replay_whose_client_leaves_while_it_is_built_writes_nothing_and_stays_kept(
        gateway: Gateway, held: tuple[EmbeddingsService, Held, list[str]]) -> None:
    _, builds, settles = held
    body = {"model": MODEL, "input": TEXTS}
    builds.release.set()
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-in-replay"})
    assert first.status_code == 200 and settles == ["ok"]
    builds.begun.clear()
    builds.release.clear()
    send_and_leave(gateway, body, {"Idempotency-Key": "leave-in-replay"}, builds.begun.is_set, "its body's build")
    time.sleep(0.5)
    builds.release.set()
    assert builds.done.wait(10)
    with gateway.client(gateway.tenant_key) as c:  # the answer is still kept: replayed, the same bytes
        again = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-in-replay"})
    assert again.headers[REPLAY] == "true" and again.content == first.content
    assert settles == ["ok"]  # replays write no row
    assert sorted(r.status for r in gateway.ledger_rows()) == ["ok", "ok"]  # the warm-up, the first
