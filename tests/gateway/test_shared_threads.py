"""One tenant's costly requests wait on each other, not on the threads every tenant's requests use.

asyncio's default executor (six threads on two cores) runs the cache's lookups; a tenant that held those threads
(long prompts or embeddings inputs being counted, here made to block) made another tenant's temperature-0 request
wait on it.
"""

from __future__ import annotations

import threading
import time

import pytest

import gateway.pipeline.prompt as prompt_stage
from gateway.embeddings_service import EmbeddingsService
from tests.conftest import Gateway

MODEL = "all-MiniLM-L6-v2"  # the embeddings model the test gateway serves
LONG = "tell me about the rivers and the mountains " * 120  # over INLINE_CHARS: counted on a worker thread


def test_long_prompts_being_counted_do_not_hold_up_another_tenants_cache_lookup(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(LONG) > prompt_stage.INLINE_CHARS
    real, release, counting = prompt_stage._count_bounded, threading.Event(), []

    def slow_count(*args: object, **kwargs: object) -> object:
        counting.append(1)
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(prompt_stage, "_count_bounded", slow_count)
    gateway.store.create_tenant("beta", "standard")
    _, beta = gateway.store.issue_key("beta")
    answers: list[int] = []

    def long_request() -> None:
        with gateway.client(gateway.tenant_key) as c:
            answers.append(c.post("/v1/chat/completions", json={
                "model": "mid", "messages": [{"role": "user", "content": LONG}]}).status_code)

    senders = [threading.Thread(target=long_request) for _ in range(8)]  # more than the default executor's threads
    for t in senders:
        t.start()
    try:
        deadline = time.time() + 10
        while not counting and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the rest have been sent and wait for a counting thread
        assert counting and not answers
        with gateway.client(beta) as c:
            r = c.post("/v1/chat/completions", timeout=5, json={
                "model": "mid", "temperature": 0, "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss" and not release.is_set()
    finally:
        release.set()
        for t in senders:
            t.join(30)
    assert answers == [200] * 8


def test_embeddings_inputs_being_counted_do_not_hold_up_another_tenants_cache_lookup(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    real, release, counting = EmbeddingsService._num_tokens, threading.Event(), []

    def slow_count(self: EmbeddingsService, texts: list[str]) -> int:
        counting.append(1)
        release.wait(20)
        return real(self, texts)

    monkeypatch.setattr(EmbeddingsService, "_num_tokens", slow_count)
    gateway.store.create_tenant("beta", "standard")
    _, beta = gateway.store.issue_key("beta")
    answers: list[int] = []

    def embed() -> None:
        with gateway.client(gateway.tenant_key) as c:
            answers.append(c.post("/v1/embeddings", json={"model": MODEL, "input": ["rivers"] * 4}).status_code)

    senders = [threading.Thread(target=embed) for _ in range(8)]
    for t in senders:
        t.start()
    try:
        deadline = time.time() + 30  # the first request loads the embeddings service
        while not counting and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert counting and not answers
        with gateway.client(beta) as c:
            r = c.post("/v1/chat/completions", timeout=5, json={
                "model": "mid", "temperature": 0, "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss" and not release.is_set()
    finally:
        release.set()
        for t in senders:
            t.join(30)
    assert answers == [200] * 8
