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


def spin(until: threading.Event) -> None:
    """A compile that never ends by itself: it uses CPU all along, as a runaway native compile would."""
    while not until.is_set():
        sum(range(1000))


def test_a_compile_spinning_past_its_cpu_bound_is_a_503(serve: Any) -> None:
    eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer(), compile_stuck_after_s=0.3)
    url = serve(eng)
    wedged = threading.Event()
    job = eng.compiles.submit("tenant-a", lambda: spin(wedged))
    try:
        health = health_until(url, 503, timeout_s=60)  # a compile thread runs at a lower priority: CPU comes slowly
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "compile" in health.json()["reason"] and eng.dead_reason is None
    finally:
        wedged.set()
    job.result(timeout=30)
    assert health_until(url, 200).json()["status"] == "ok"


def test_a_compile_that_waits_long_is_not_wedged(serve: Any) -> None:
    """Compile threads yield to the engine's steps, so on a busy engine a compile can take minutes of wall time for
    a fraction of a second of CPU: restarting the engine for it would be an outage any tenant could cause. Only CPU
    spent counts, so a compile that waits three times the bound leaves /health at 200 throughout."""
    eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer(), compile_stuck_after_s=0.3)
    url = serve(eng)
    done = threading.Event()
    job = eng.compiles.submit("tenant-a", lambda: done.wait(timeout=30))
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        time.sleep(0.1)
    done.set()
    job.result(timeout=5)
