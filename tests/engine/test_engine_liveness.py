"""/health tells the truth about an engine that is alive but cannot serve.

A loop thread wedged inside one step (a forward pass that never returns) or a grammar compile thread that never
ends leaves the loop alive, so `dead_reason` is None; /health must still answer 503 so the supervisor
(tiers/supervisor.py: any status but 200 is a failed probe) restarts the engine. A step that is only slow, or a
compile that is only slow, is not an outage: below the engine's bounds /health stays 200.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread


class WedgedRunner(ScriptedRunner):
    """Its first step blocks until `unblock` is set (a forward pass wedged in a native call)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unblock = threading.Event()

    def run(self, out: Any) -> list[int]:
        self.unblock.wait(timeout=30)
        return super().run(out)


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[tuple[ServerThread, LLMEngine]] = []

    def start(eng: LLMEngine) -> str:
        eng.start()
        server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
        started.append((server, eng))
        return server.url

    yield start
    for server, eng in started:
        server.stop()
        eng.shutdown()


def health_until(url: str, status: int, timeout_s: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{url}/health", timeout=5)
        if health.status_code == status or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_a_step_wedged_past_the_bound_is_a_503_and_a_slow_one_is_not(serve: Any) -> None:
    runner = WedgedRunner(max_model_len=512)
    eng = LLMEngine(runner, CharTokenizer(), stuck_after_s=1.0)
    url = serve(eng)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    chat = threading.Thread(target=httpx.post, args=(f"{url}/v1/chat/completions",), kwargs={"json": body,
                                                                                              "timeout": 30})
    chat.start()
    time.sleep(0.5)  # inside the step, below the bound: slow, not stuck
    assert httpx.get(f"{url}/health").status_code == 200
    health = health_until(url, 503)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "step" in health.json()["reason"] and eng.dead_reason is None  # alive, but not serving
    runner.unblock.set()  # it comes back: healthy again
    assert health_until(url, 200).json()["status"] == "ok"
    chat.join(timeout=10)


def test_a_wedged_grammar_compile_is_a_503_and_a_slow_one_is_not(serve: Any) -> None:
    eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer(), compile_stuck_after_s=1.0)
    url = serve(eng)
    wedged = threading.Event()
    job = eng.compiles.submit("tenant-a", lambda: wedged.wait(timeout=30))
    time.sleep(0.5)
    assert httpx.get(f"{url}/health").status_code == 200
    health = health_until(url, 503)
    assert health.status_code == 503 and "compile" in health.json()["reason"]
    wedged.set()
    job.result(timeout=5)
    assert health_until(url, 200).json()["status"] == "ok"
