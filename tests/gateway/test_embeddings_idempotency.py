"""Idempotency-Key on POST /v1/embeddings, as on chat: an answer lost on the way back is replayed to the SDK's retry
(`x-tiergate-idempotent-replay: true`), billed and written once, on every store; the same key with another body, or
used on another route, is a 422; a retry while the first runs waits for it or gets a 409; the largest answer is
kept (its vectors stored compactly), and one over the store's bound is answered and run again, as chat's."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from gateway.embeddings_service import EmbeddingsService
from gateway.settings import Settings
from quotas.idempotency import Limits
from tests.conftest import Gateway, running_gateway
from tests.fault_proxy import DroppingProxy
from tests.stubs import ServerThread, StubState

MODEL = "all-MiniLM-L6-v2"
REPLAY = "x-tiergate-idempotent-replay"
TEXTS = ["How do I reset my password?", "The weather in Paris is mild in spring."]


def service(gw: Gateway) -> EmbeddingsService:
    """The gateway's embeddings service, built by a first request (whose row the caller accounts for)."""
    with gw.client(gw.tenant_key) as c:
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    return gw.app.state.embeddings


def post(gw: Gateway, body: dict[str, Any], key: str, path: str = "/v1/embeddings") -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        return c.post(path, json=body, headers={"idempotency-key": key})


@pytest.mark.parametrize("store", ["sqlite", "postgres", "redis"])
def test_a_lost_answer_is_replayed_to_the_sdks_retry_and_billed_once(
        store: str, gateway_settings: Settings, stub: tuple[ServerThread, StubState],
        request: pytest.FixtureRequest) -> None:
    """SQLite and PostgreSQL store the answer in the row's transaction, Redis once the row is durable."""
    if store != "sqlite":
        url = request.getfixturevalue("database_url" if store == "postgres" else "redis_url")
        gateway_settings = gateway_settings.model_copy(update={f"{'database' if store == 'postgres' else 'redis'}_url":
                                                               url})
    with running_gateway(gateway_settings, stub[1]) as gw:
        proxy = DroppingProxy(int(gw.url.rsplit(":", 1)[1])).start()
        try:
            with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=gw.tenant_key, max_retries=2, timeout=60) as sdk:
                raw = sdk.embeddings.with_raw_response.create(model=MODEL, input=TEXTS,
                                                              extra_headers={"Idempotency-Key": "order-42"})
                out = raw.parse()
            assert proxy.dropped == 1  # the first answer was lost, the SDK retried
        finally:
            proxy.stop()
        assert raw.headers[REPLAY] == "true"
        (row,) = gw.ledger_rows()  # one run, one row, billed once
        assert row.tier == "embeddings" and row.status == "ok" and row.input_tokens == out.usage.prompt_tokens > 0
        # the replayed vectors are those computed, bit for bit (the SDK asked for base64)
        again = post(gw, {"model": MODEL, "input": TEXTS, "encoding_format": "base64"}, "order-42")
        assert again.headers[REPLAY] == "true" and again.json()["usage"]["prompt_tokens"] == row.input_tokens
        fresh = post(gw, {"model": MODEL, "input": TEXTS, "encoding_format": "base64"}, "another")
        assert REPLAY not in fresh.headers
        assert [d.embedding for d in out.data] == [
            list(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")) for d in again.json()["data"]]
        np.testing.assert_allclose(np.array([d.embedding for d in out.data]), np.array(
            [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in fresh.json()["data"]]), atol=1e-5)
        assert len(gw.ledger_rows()) == 2  # the fresh key's run; no replay writes a row


def test_the_same_key_with_another_body_or_on_another_route_is_a_422(gateway: Gateway) -> None:
    first = post(gateway, {"model": MODEL, "input": TEXTS}, "k")
    other = post(gateway, {"model": MODEL, "input": "another text"}, "k")
    chat = post(gateway, {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}, "k",
                "/v1/chat/completions")
    assert first.status_code == 200 and REPLAY not in first.headers
    for refused in (other, chat):
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "Idempotency-Key"
        assert refused.json()["error"]["code"] == "idempotency_key_reused"
    # and a key a chat request holds does not answer an embeddings request
    assert post(gateway, {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}, "c",
                "/v1/chat/completions").status_code == 200
    assert post(gateway, {"model": MODEL, "input": TEXTS}, "c").status_code == 422
    bad = post(gateway, {"model": MODEL, "input": TEXTS}, "x" * 300)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"
    assert [r.tier for r in gateway.ledger_rows()] == ["embeddings", "mid"]


@pytest.fixture
def held(gateway: Gateway) -> Iterator[tuple[threading.Event, list[int]]]:
    """The gateway's forward passes held until the event is set; the texts of each pass begun."""
    svc = service(gateway)
    real: Callable[[list[str]], Any] = svc.batcher.encode_many
    release, begun = threading.Event(), []

    def slow(texts: list[str]) -> Any:
        begun.append(len(texts))
        release.wait(30)
        return real(texts)

    svc.batcher.encode_many = slow
    yield release, begun
    release.set()


def test_a_retry_while_the_first_runs_waits_for_it_or_gets_a_409(
        gateway: Gateway, held: tuple[threading.Event, list[int]]) -> None:
    release, begun = held
    body = {"model": MODEL, "input": TEXTS}
    results: dict[str, httpx.Response] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", post(gateway, body, "slow")))
    first.start()
    deadline = time.time() + 30
    while not begun and time.time() < deadline:  # claimed, and its pass begun
        time.sleep(0.02)
    gateway.app.state.services.pipeline.idempotency.wait_s = 0.2
    busy = post(gateway, body, "slow")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "idempotency_key_in_use"
    assert int(busy.headers["retry-after"]) >= 1
    gateway.app.state.services.pipeline.idempotency.wait_s = 30
    waiter = threading.Thread(target=lambda: results.setdefault("waited", post(gateway, body, "slow")))
    waiter.start()
    time.sleep(0.3)
    release.set()
    first.join(30)
    waiter.join(30)
    assert results["first"].status_code == results["waited"].status_code == 200
    assert REPLAY not in results["first"].headers and results["waited"].headers[REPLAY] == "true"
    assert results["waited"].json() == results["first"].json()
    assert len(begun) == 1 and len(gateway.ledger_rows()) == 2  # the warm-up's and the key's


def test_the_largest_answer_is_kept_and_one_over_the_stores_bound_is_not_run_again(gateway: Gateway) -> None:
    """2,048 vectors are 4 MiB as base64 and about 16 as JSON floats: stored as base85 they fit the store's bound
    for one answer (4 MiB). An answer over a bound set smaller is answered, not stored, and a retry is told so (409
    `idempotency_answer_not_kept`), neither run nor billed again, as a chat answer over it is."""
    body = {"model": MODEL, "input": [f"text {i % 7}" for i in range(2048)], "encoding_format": "base64"}
    first, again = post(gateway, body, "big"), post(gateway, body, "big")
    assert first.status_code == again.status_code == 200, first.text
    assert again.headers[REPLAY] == "true" and again.content == first.content
    assert len(gateway.ledger_rows()) == 1

    gateway.app.state.services.pipeline.idempotency.store.limits = Limits(answer_bytes=1000)
    small = {"model": MODEL, "input": TEXTS}
    runs = [post(gateway, small, "over") for _ in range(2)]
    assert [r.status_code for r in runs] == [200, 409] and not any(REPLAY in r.headers for r in runs)
    assert runs[1].json()["error"]["code"] == "idempotency_answer_not_kept"
    assert len(gateway.ledger_rows()) == 2
