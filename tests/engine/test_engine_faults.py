"""An engine never dies from one sequence, and a loop that dies anyway shows at once.

A sequence whose sampling fails fails alone; a forward pass that fails fails its step; either way the
caller gets an OpenAI-shaped error (a 500, or an error event in a stream) and the engine serves on. A loop
that dies ends every request in flight at once, refuses new ones with a 503, and /health says so within a
second; /health never waits on a step, however slow.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.block_manager import BlockManager
from engine.grammar import GrammarError
from engine.llm_engine import EngineDeadError, LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, FaultyRunner, ScriptedRunner, collect
from tests.stubs import ServerThread
from wire.errors import RESPONSE_FORMAT_FAILED

GREEDY = SamplingParams(temperature=0, max_tokens=64)
REPLY = "Paris is the capital."


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def scheduler_bug() -> Any:
    raise RuntimeError("scheduler bug")


# ---- the engine, called directly ----


async def test_a_sequence_whose_sampling_fails_fails_alone_and_the_others_of_its_step_finish() -> None:
    runner = FaultyRunner()
    eng = LLMEngine(runner, CharTokenizer(), max_num_seqs=4)
    # queued before the loop starts, so the three share every step
    tasks = [asyncio.ensure_future(collect(eng.generate(ids(p), GREEDY, request_id=p)))
             for p in ("good-1", "SAMPLE-FAIL", "good-2")]
    await asyncio.sleep(0.05)
    eng.start()
    try:
        (text_1, out_1), (text_bad, bad), (text_2, out_2) = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert len(runner.steps[0].seqs) == 3
        assert text_1 == text_2 == REPLY and out_1.error is None and out_2.finish_reason == "stop"
        assert (text_bad, bad.finished, bad.finish_reason, bad.error_code) == ("", True, "error", "engine_error")
        assert "sampling failed" in (bad.error or "")
        stats = eng.stats()
        assert stats.num_kv_blocks_used == 0 and "SAMPLE-FAIL" in runner.released
        assert stats.num_requests_failed == 1 and eng.dead_reason is None
        text, _ = await asyncio.wait_for(collect(eng.generate(ids("again"), GREEDY)), 5)
        assert text == REPLY
    finally:
        eng.shutdown()


async def test_a_failed_forward_pass_fails_its_step_and_the_engine_serves_on() -> None:
    runner = FaultyRunner()
    eng = LLMEngine(runner, CharTokenizer())
    eng.start()
    try:
        text, bad = await asyncio.wait_for(collect(eng.generate(ids("FORWARD-FAIL"), GREEDY)), 5)
        assert text == "" and bad.error_code == "engine_error" and "forward pass failed" in (bad.error or "")
        assert eng.stats().num_kv_blocks_used == 0 and runner.released == [bad.request_id]
        text, good = await asyncio.wait_for(collect(eng.generate(ids("fine"), GREEDY)), 5)
        assert text == REPLY and good.error is None and eng.dead_reason is None
    finally:
        eng.shutdown()


async def test_a_loop_that_dies_ends_every_request_at_once_and_refuses_new_ones() -> None:
    runner = ScriptedRunner(reply="x" * 400, step_s=0.01, max_model_len=512)
    eng = LLMEngine(runner, CharTokenizer())
    eng.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=400)
        streams = [eng.generate(ids(p), params) for p in ("one", "two")]
        for gen in streams:
            assert (await asyncio.wait_for(anext(gen), 5)).error is None
        eng.scheduler.schedule = scheduler_bug  # type: ignore[method-assign]  # outside any sequence's isolation
        t0 = time.monotonic()
        lasts = [[out async for out in gen][-1] for gen in streams]
        assert time.monotonic() - t0 < 1.0
        for last in lasts:
            assert last.finished and last.error_code == "engine_dead" and "scheduler bug" in (last.error or "")
        assert "scheduler bug" in (eng.dead_reason or "")
        with pytest.raises(EngineDeadError):
            await anext(eng.generate(ids("late"), GREEDY))
    finally:
        eng.shutdown()


def test_the_model_runner_fails_only_the_sequence_whose_sampling_raises(tiny_llama: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def first_step(fail: str | None) -> tuple[list[int], ModelRunner]:
        runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)
        sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=runner.max_model_len, eos_token_ids=set())
        for rid in ("a", "b", "c"):
            sched.add_request(Sequence(rid, [1, 2, 3, 4], SamplingParams(temperature=0.8, seed=7, max_tokens=4,
                                                                         logprobs=1)))
        sample = runner.sampler.sample

        def failing(request_id: str, logits: Any, params: SamplingParams, *output: Any) -> int:
            if request_id == fail:
                raise ValueError("bad logits")
            return sample(request_id, logits, params, *output)

        monkeypatch.setattr(runner.sampler, "sample", failing)
        return runner.run(sched.schedule()), runner

    clean, _ = first_step(None)
    tokens, runner = first_step("b")
    assert tokens == [clean[0], -1, clean[2]]  # the others sample exactly what they would have
    assert runner.last_errors == {"b": "ValueError: bad logits"} and set(runner.last_logprobs) == {"a", "c"}
    assert runner.last_error_codes == {}  # an engine's failure: no request-fault code


def test_a_grammar_that_cannot_go_on_is_the_requests_own_failure(tiny_llama: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=runner.max_model_len, eos_token_ids=set())
    for rid in ("a", "b"):
        sched.add_request(Sequence(rid, [1, 2, 3, 4], SamplingParams(temperature=0.8, seed=7, max_tokens=4)))
    sample = runner.sampler.sample

    def failing(request_id: str, logits: Any, params: SamplingParams, *output: Any) -> int:
        if request_id == "b":
            raise GrammarError("the response_format grammar failed: Current row has 3999 items; max is 2000")
        return sample(request_id, logits, params, *output)

    monkeypatch.setattr(runner.sampler, "sample", failing)
    tokens = runner.run(sched.schedule())
    assert tokens[1] == -1 and tokens[0] != -1
    assert runner.last_error_codes == {"b": RESPONSE_FORMAT_FAILED} and "3999 items" in runner.last_errors["b"]


# ---- over HTTP ----


MSG = [{"role": "user", "content": "capital of France?"}]


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[tuple[ServerThread, LLMEngine]] = []

    def start(runner: Any, tokenizer: Any = None) -> tuple[str, LLMEngine]:
        eng = LLMEngine(runner, tokenizer or CharTokenizer())
        eng.start()
        server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
        started.append((server, eng))
        return server.url, eng

    yield start
    for server, eng in started:
        server.stop()
        eng.shutdown()


def sse_events(url: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=10) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_failed_request_is_an_openai_error_streamed_or_not(serve: Any) -> None:
    url, eng = serve(FaultyRunner(max_model_len=512))
    bad = {"model": "tiny", "messages": [{"role": "user", "content": "SAMPLE-FAIL"}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=bad, timeout=10)
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("api_error", None, "engine_error")
    events = sse_events(url, bad)
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-2])  # no content was made up
    good = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MSG}, timeout=10)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == REPLY
    assert eng.stats().num_kv_blocks_used == 0
    assert "tiergate_engine_requests_failed_total{model=\"tiny\"} 2.0" in httpx.get(f"{url}/metrics").text


def test_a_response_format_that_cannot_go_on_is_a_400_naming_it_streamed_or_not(serve: Any) -> None:
    """A tenant's schema whose grammar fails mid-answer is the request's error (400 `response_format_failed`),
    which the gateway does not count against the replica (tests/gateway/test_breaker_api.py), not a 500."""
    url, eng = serve(FaultyRunner(max_model_len=512))
    bad = {"model": "tiny", "messages": [{"role": "user", "content": "GRAMMAR-FAIL"}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=bad, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "response_format",
                                                        "response_format_failed")
    events = sse_events(url, bad)
    assert json.loads(events[-2])["error"]["code"] == "response_format_failed" and events[-1] == "[DONE]"
    assert eng.stats().num_kv_blocks_used == 0


def test_a_dead_loop_shows_in_health_within_a_second_and_ends_requests_at_once(serve: Any) -> None:
    url, eng = serve(ScriptedRunner(reply="x" * 2000, step_s=0.01, max_model_len=4096, num_kv_blocks=512))
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2000}
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=30)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=30) as r:
            lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)  # the role chunk, then content: the stream is under way
            deadline = time.monotonic() + 5
            while eng.stats().num_running < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            eng.scheduler.schedule = scheduler_bug  # type: ignore[method-assign]
            t0 = time.monotonic()
            rest = list(lines)
            assert time.monotonic() - t0 < 1.0
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead" and rest[-1] == "[DONE]"
        answer = plain.result(timeout=1)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert "scheduler bug" in health.json()["reason"]
    late = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"


class BlockingRunner(ScriptedRunner):
    """Its first step blocks until released (a very slow forward pass)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release_step = threading.Event()

    def run(self, out: Any) -> list[int]:
        self.release_step.wait(timeout=10)
        return super().run(out)


class SlowDecodeTokenizer(CharTokenizer):
    """Its first decode takes `delay_s` (a slow detokenization or stop-string pass)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        delay, self.delay_s = self.delay_s, 0.0
        time.sleep(delay)
        return super().decode(ids, skip_special_tokens)


def test_health_never_waits_on_a_step_or_its_postprocessing(serve: Any) -> None:
    runner = BlockingRunner(max_model_len=512)
    url, _ = serve(runner, SlowDecodeTokenizer(delay_s=2.0))
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(httpx.post, f"{url}/v1/chat/completions",
                           json={"model": "tiny", "messages": MSG, "max_tokens": 2}, timeout=30)
        slowest = 0.0
        t_end = time.monotonic() + 4.0
        while time.monotonic() < t_end:
            if time.monotonic() > t_end - 2.0:
                runner.release_step.set()  # after 2 s of a blocked step, 2 s of a slow decode
            t0 = time.perf_counter()
            health = httpx.get(f"{url}/health", timeout=5)
            slowest = max(slowest, time.perf_counter() - t0)
            assert health.status_code == 200 and health.json()["status"] == "ok"
            time.sleep(0.05)
        assert chat.result(timeout=10).status_code == 200
    assert slowest < 0.8, f"/health took {slowest:.2f}s during a slow step (2 s) or decode (2 s)"
