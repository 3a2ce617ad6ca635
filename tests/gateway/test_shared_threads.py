"""One tenant's costly requests wait on each other, not on the threads every tenant's requests use.

asyncio's default executor (six threads on two cores) runs the cache's lookups; a tenant that held those threads
(usage reports, long prompts or embeddings inputs being counted, `auto`'s difficulty predictions: each made to
block here) made another tenant's temperature-0 request wait on it, past a 5 s timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import gateway.pipeline.prompt as prompt_stage
from gateway.app import prediction_threads
from gateway.embeddings_service import EmbeddingsService
from tests.conftest import Gateway
from tiers.predictor import PredictorSource

MODEL = "all-MiniLM-L6-v2"  # the embeddings model the test gateway serves
LONG = "tell me about the rivers and the mountains " * 120  # over INLINE_CHARS: counted on a worker thread
SENDERS = 8  # more than the default executor's threads


def blocking(real: Callable[..., object]) -> tuple[Callable[..., object], list[int], threading.Event]:
    """`real`, made to wait until released; and the calls begun, and the release."""
    begun, release = [], threading.Event()

    def held(*args: object, **kwargs: object) -> object:
        begun.append(1)
        release.wait(20)
        return real(*args, **kwargs)

    return held, begun, release


@contextmanager
def flood(gateway: Gateway, send: Callable[[httpx.Client], httpx.Response], begun: list[int],
          release: threading.Event, *, answered: int = 0) -> Iterator[list[int]]:
    """SENDERS of `send` at once from tenant acme, held inside the gateway until the block ends; yields their
    status codes (those answered so far: at least `answered`), then waits for all."""
    answers: list[int] = []

    def one() -> None:
        with gateway.client(gateway.tenant_key) as c:
            answers.append(send(c).status_code)

    senders = [threading.Thread(target=one) for _ in range(SENDERS)]
    for t in senders:
        t.start()
    try:
        deadline = time.time() + 30  # the first embeddings request loads its service
        while (not begun or len(answers) < answered) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the rest have been sent and wait, or were refused
        assert begun
        yield answers
    finally:
        release.set()
        for t in senders:
            t.join(30)


def other_tenant_asks(gateway: Gateway) -> httpx.Response:
    """Tenant beta's temperature-0 request (its cache lookup runs on the default executor)."""
    gateway.store.create_tenant("beta", "standard")
    _, beta = gateway.store.issue_key("beta")
    with gateway.client(beta) as c:
        return c.post("/v1/chat/completions", timeout=5, json={
            "model": "mid", "temperature": 0, "messages": [{"role": "user", "content": "hello there"}]})


def test_long_prompts_being_counted_do_not_hold_up_another_tenants_cache_lookup(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(LONG) > prompt_stage.INLINE_CHARS
    held, begun, release = blocking(prompt_stage._count_bounded)
    monkeypatch.setattr(prompt_stage, "_count_bounded", held)
    with flood(gateway, lambda c: c.post("/v1/chat/completions", json={
            "model": "mid", "messages": [{"role": "user", "content": LONG}]}), begun, release) as answers:
        assert not answers
        r = other_tenant_asks(gateway)
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss" and not release.is_set()
    assert answers == [200] * SENDERS


def test_embeddings_inputs_being_counted_do_not_hold_up_another_tenants_cache_lookup(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    held, begun, release = blocking(EmbeddingsService._num_tokens)
    monkeypatch.setattr(EmbeddingsService, "_num_tokens", held)
    with flood(gateway, lambda c: c.post("/v1/embeddings", json={"model": MODEL, "input": ["rivers"] * 4}),
               begun, release) as answers:
        assert not answers
        r = other_tenant_asks(gateway)
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss" and not release.is_set()
    assert answers == [200] * SENDERS


def test_a_tenants_reports_do_not_take_the_threads_other_tenants_need(gateway: Gateway,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight reports at once from one tenant: one runs, the others are refused at once with a 429."""
    processes = gateway.app.state.services.reports.processes  # a report thread waits on its report process
    held, begun, release = blocking(processes.report)
    monkeypatch.setattr(processes, "report", held)
    with flood(gateway, lambda c: c.get("/v1/usage"), begun, release, answered=SENDERS - 1) as answers:
        assert answers == [429] * (SENDERS - 1)  # refused at once, while the first still runs
        r = other_tenant_asks(gateway)
        assert r.status_code == 200 and not release.is_set()
        with gateway.client(gateway.tenant_key) as c:
            again = c.get("/v1/usage")
        assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limit_exceeded"
        assert again.headers["retry-after"] == "1"
    assert sorted(answers) == [200] + [429] * (SENDERS - 1)
    with gateway.client(gateway.tenant_key) as c:
        assert c.get("/v1/usage").status_code == 200  # the tenant's slot is free once its report is done


class Predictions:
    version = "blocking-1"

    def predict(self, messages: list[dict[str, Any]]) -> dict[str, float]:
        return {"small": 0.95, "mid": 0.97, "full": 1.0}


def test_difficulty_predictions_do_not_hold_up_another_tenants_cache_lookup(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    held, begun, release = blocking(Predictions.predict)
    monkeypatch.setattr(Predictions, "predict", held)
    (artifact := tmp_path / "difficulty.json").write_text("{}")
    route = gateway.app.state.services.pipeline.route
    monkeypatch.setattr(route, "predictor", PredictorSource(artifact, lambda _: Predictions()))
    with flood(gateway, lambda c: c.post("/v1/chat/completions", json={
            "model": "auto", "messages": [{"role": "user", "content": "hi"}]}), begun, release) as answers:
        assert not answers
        r = other_tenant_asks(gateway)
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss" and not release.is_set()
    assert answers == [200] * SENDERS
    route.predictor.close()


class Turns:
    """Lets held calls through one at a time (`one`), or all at once (`set`, as `flood` ends)."""

    def __init__(self) -> None:
        self._one, self._all = threading.Semaphore(0), threading.Event()

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while not self._all.is_set() and time.time() < deadline:
            if self._one.acquire(timeout=0.05):
                return

    def one(self) -> None:
        self._one.release()

    def set(self) -> None:
        self._all.set()

    def is_set(self) -> bool:
        return self._all.is_set()


def held_for(real: Callable[..., object], text: str, text_at: Callable[..., str]
             ) -> tuple[Callable[..., object], list[int], Turns]:
    """`real`, held until its turn when its call's text (`text_at(*args)`) is `text`; other calls run at once."""
    begun, turns = [], Turns()

    def held(*args: object) -> object:
        if text_at(*args) == text:
            begun.append(1)
            turns.wait(20)
        return real(*args)

    return held, begun, turns


def beta_waits_two_turns(gateway: Gateway, body: Callable[[str], dict[str, Any]], begun: list[int],
                         turns: Turns) -> None:
    """SENDERS of acme's `body(LONG)` fill the threads and their queue; beta's `body(other)`, queued last, is
    answered once two of acme's are let through (one running, one started from the queue), not after all."""
    with flood(gateway, lambda c: c.post("/v1/chat/completions", json=body(LONG)), begun, turns) as answers:
        gateway.store.create_tenant("beta", "standard")
        _, beta = gateway.store.issue_key("beta")
        got: list[httpx.Response] = []

        def ask() -> None:
            with gateway.client(beta) as c:
                got.append(c.post("/v1/chat/completions", timeout=20, json=body(LONG.replace("rivers", "lakes"))))

        asks = threading.Thread(target=ask)
        asks.start()
        time.sleep(0.5)  # beta's job is queued behind acme's
        turns.one()
        turns.one()
        asks.join(15)
        assert got and got[0].status_code == 200 and not turns.is_set()
        assert len(answers) <= 2  # acme's others are still held
    assert answers == [200] * SENDERS


def test_a_tenants_queued_long_prompts_do_not_hold_up_another_tenants_long_prompt(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    held, begun, turns = held_for(prompt_stage._count_bounded, LONG,
                                  lambda _counter, _originals, messages, *_: messages[-1]["content"])
    monkeypatch.setattr(prompt_stage, "_count_bounded", held)
    beta_waits_two_turns(gateway, lambda text: {"model": "mid", "messages": [{"role": "user", "content": text}]},
                         begun, turns)


def test_a_tenants_queued_predictions_do_not_hold_up_another_tenants_prediction(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    held, begun, turns = held_for(Predictions.predict, LONG, lambda _self, messages: messages[-1]["content"])
    monkeypatch.setattr(Predictions, "predict", held)
    (artifact := tmp_path / "difficulty.json").write_text("{}")
    route = gateway.app.state.services.pipeline.route
    monkeypatch.setattr(route, "predictor", PredictorSource(artifact, lambda _: Predictions(),
                                                            threads=prediction_threads()))
    beta_waits_two_turns(gateway, lambda text: {"model": "auto", "messages": [{"role": "user", "content": text}]},
                         begun, turns)
    route.predictor.close()
