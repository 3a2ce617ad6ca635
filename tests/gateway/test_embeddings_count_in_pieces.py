"""An embeddings request's texts are counted a piece at a time, each piece a job of the counting threads in the
tenant's turn: counted in one job, a body of 4 MiB held a thread for all of it (seconds, up to 19 s of texts the
tokenizer splits slowly), and another tenant's count waited behind it. Here the counting threads are one, and the
first tenant's count is held until the other's is queued: the other's runs after one piece, not after all."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from gateway import embeddings_service
from gateway.embeddings_service import EmbeddingsService
from gateway.fair_threads import FairThreads
from tests.conftest import Gateway

MODEL = "all-MiniLM-L6-v2"


class HeldCounts:
    """The service's embedder, with each text counted recorded; the first count of an "A" text waits for
    `release`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.counted: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def num_tokens(self, text: str) -> int:
        if text.startswith("A") and not self.started.is_set():
            self.started.set()
            self.release.wait(30)
        self.counted.append(text[0])
        return self.real.num_tokens(text)


def test_another_tenants_count_waits_for_a_piece_not_for_the_whole_request(gateway: Gateway,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    svc: EmbeddingsService = gateway.app.state.embeddings
    svc.counting = FairThreads(1, "test-count")
    held = svc.embedder = HeldCounts(svc.embedder)  # type: ignore[assignment]
    gateway.store.create_tenant("globex", "standard")
    _, other_key = gateway.store.issue_key("globex", name="theirs")
    monkeypatch.setattr(embeddings_service, "COUNT_PIECE_CHARS", 4000)  # pieces of four texts: a small body
    texts = ["A" + "x " * 500] * 16  # four pieces
    answers: dict[str, httpx.Response] = {}

    def post(name: str, key: str, body: dict[str, Any]) -> None:
        with gateway.client(key) as c:
            answers[name] = c.post("/v1/embeddings", json={"model": MODEL} | body, timeout=120)

    first = threading.Thread(target=post, args=("a", gateway.tenant_key, {"input": texts}))
    first.start()
    assert held.started.wait(30), answers
    second = threading.Thread(target=post, args=("b", other_key, {"input": "B is for another tenant"}))
    second.start()
    deadline = time.time() + 30
    while svc.counting.queued == 0 and time.time() < deadline:  # the other tenant's count waits for the thread
        time.sleep(0.01)
    held.release.set()
    first.join(120)
    second.join(120)
    assert answers["a"].status_code == answers["b"].status_code == 200, (answers["a"].text, answers["b"].text)
    assert answers["a"].json()["usage"]["prompt_tokens"] == len(texts) * 256
    at = held.counted.index("B")
    assert 0 < at <= len(texts) // 2, at  # after the first piece: the first tenant's texts counted before it
