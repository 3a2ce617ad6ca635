"""A tenant's response-format compiles against another's: they never run on the event loop's default executor, and a
flood of slow ones from one tenant leaves another's compile (and its request) waiting at most one compile. A fake
compile that sleeps SLOW_S stands for a schema llguidance takes long over; the scripted runner never reads it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner, collect
from tests.stubs import ServerThread

SLOW_S = 0.4
GATE_S = 60.0  # the longest a gated slow compile waits for its test to let it end
MSG = [{"role": "user", "content": "JSON please"}]
# the default executor's threads (asyncio's ThreadPoolExecutor), three times over
FLOOD = 3 * min(32, (os.cpu_count() or 1) + 4)


def fmt(title: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "title": title}}}


class FakeCompiles:
    """Stands in for GrammarCache.compile: compiles each schema once per tenant (a repeat is a cache hit, as there),
    recording the thread each compile ran on; the attacker's ("slow…") sleep."""

    def __init__(self, engine: LLMEngine, gate: threading.Event | None = None) -> None:
        """With `gate`, a slow compile waits for it to be set (at most GATE_S) instead of sleeping SLOW_S."""
        self.gate = gate
        self.threads: list[str] = []
        self.done: dict[str, float] = {}  # schema title -> when its compile ended
        self._compiled: dict[tuple[str | None, str], object] = {}
        self._lock = threading.Lock()
        engine.grammars.compile = self  # type: ignore[method-assign]

    def __call__(self, f: Any, tenant: str | None) -> object:
        title = f.json_schema.schema_["title"]
        with self._lock:
            if (tenant, title) in self._compiled:
                return self._compiled[tenant, title]
        self.threads.append(threading.current_thread().name)
        if title.startswith("slow"):
            if self.gate is not None:
                self.gate.wait(GATE_S)
            else:
                time.sleep(SLOW_S)
        with self._lock:
            self.done[title] = time.perf_counter()
            return self._compiled.setdefault((tenant, title), object())  # the scripted runner never masks with it


def on_default_executor(name: str) -> bool:
    return name == "MainThread" or name.startswith(("asyncio", "ThreadPoolExecutor"))


async def test_a_flood_of_slow_compiles_delays_another_tenants_by_one_compile_at_most() -> None:
    engine = LLMEngine(ScriptedRunner(), CharTokenizer())
    compiles = FakeCompiles(engine)
    engine.start()
    refused: list[str] = []

    async def attacker(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt(f"slow{i}"))
        try:
            await collect(engine.generate([65, 66], params, cache_salt="attacker"))
        except Exception as exc:  # the queue's refusal (EngineBusyError: not at HEAD), counted below
            refused.append(type(exc).__name__)

    try:
        flood = [asyncio.create_task(attacker(i)) for i in range(FLOOD)]
        await asyncio.sleep(0.1)  # the flood is queued
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt("victim"))
        text, last = await collect(engine.generate([65, 66], params, cache_salt="victim"))
        victim_s = time.perf_counter() - t0
        await asyncio.gather(*flood)
    finally:
        engine.shutdown()
    assert text == "Pa" and last.error is None
    # at HEAD: behind FLOOD compiles on the default executor's threads, ~3 x SLOW_S
    assert compiles.done["victim"] - t0 < SLOW_S and victim_s < SLOW_S, victim_s
    assert not [name for name in compiles.threads if on_default_executor(name)], compiles.threads
    # the attacker's compiles beyond its share are refused at once; those it was given ran, one at a time
    assert refused and set(refused) == {"EngineBusyError"}
    assert len(refused) + sum(t.startswith("slow") for t in compiles.done) == FLOOD


@pytest.fixture
def served() -> Iterator[tuple[str, LLMEngine, FakeCompiles]]:
    engine = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer())
    compiles = FakeCompiles(engine, gate=threading.Event())
    engine.start()
    server = ServerThread(create_engine_app(engine, model_name="tiny", model_version="v1")).start()
    yield server.url, engine, compiles
    compiles.gate.set()  # type: ignore[union-attr]
    server.stop()
    engine.shutdown()


def test_over_http_the_flood_is_refused_with_429_and_the_victim_is_served(
        served: tuple[str, LLMEngine, FakeCompiles]) -> None:
    """The attacker's compiles never end until the victim is answered (they wait on a gate): the victim is served
    while every one of them still holds its place, so it waited for none of them, however loaded the machine (at the
    HEAD this test was written against: its tokenizing and compile queued behind the flood's on the default
    executor, and it was never answered)."""
    url, engine, compiles = served
    assert compiles.gate is not None

    def post(tenant: str, title: str, timeout_s: float = 30) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", timeout=timeout_s, headers={"x-tiergate-cache-salt": tenant},
                          json={"model": "tiny", "messages": MSG, "max_tokens": 2, "response_format": fmt(title)})

    with ThreadPoolExecutor(FLOOD) as pool:
        flood = [pool.submit(post, "attacker", f"slow{i}") for i in range(FLOOD)]
        deadline = time.monotonic() + 20
        while engine.compiles.num_refused < FLOOD - engine.compiles.per_tenant and time.monotonic() < deadline:
            time.sleep(0.01)  # the flood is in: its share queued or running, the rest refused
        try:
            victim = post("victim", "victim", timeout_s=20)
            slow_ended = [title for title in compiles.done if title.startswith("slow")]
        finally:
            compiles.gate.set()  # the flood's compiles end now, answered or not
        statuses = [f.result().status_code for f in flood]
    assert victim.status_code == 200, victim.text
    assert slow_ended == [], slow_ended  # answered while every slow compile still ran or waited
    assert not [name for name in compiles.threads if on_default_executor(name)], compiles.threads
    assert statuses.count(200) == engine.compiles.per_tenant and statuses.count(429) == FLOOD - statuses.count(200)
    busy = next(f.result() for f in flood if f.result().status_code == 429)
    assert busy.json()["error"]["code"] == "response_format_compiles_busy" and busy.headers["retry-after"] == "1"


async def test_a_burst_of_one_new_schema_is_compiled_once_and_takes_one_place_in_the_queue() -> None:
    """A client sending the same new schema many times at once (more than a tenant's places in the compile queue)
    gets every answer: the requests wait for one compile instead of each queueing its own and being refused."""
    engine = LLMEngine(ScriptedRunner(), CharTokenizer())
    compiles = FakeCompiles(engine)
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt("slow-burst"))
        results = await asyncio.gather(*(collect(engine.generate([65, 66], params, cache_salt="t"))
                                         for _ in range(3 * engine.compiles.per_tenant)))
        assert len(results) == 3 * engine.compiles.per_tenant and len(compiles.threads) == 1
        assert engine.compiles.num_refused == 0 and not engine._compiling
    finally:
        engine.shutdown()


async def test_a_schema_queued_behind_one_tenants_flood_does_not_hold_another_tenant_there() -> None:
    """The attacker queues slow schemas and then one it guessed another tenant uses (a popular tool's): that
    tenant's request for it compiles in its own turn, not at the attacker's place in line (found in review)."""
    engine = LLMEngine(ScriptedRunner(), CharTokenizer())
    FakeCompiles(engine)
    engine.start()
    try:
        async def attacker(title: str) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt(title))
            await collect(engine.generate([65, 66], params, cache_salt="attacker"))

        flood = [asyncio.create_task(attacker(f"slow{i}")) for i in range(7)]
        await asyncio.sleep(0.05)
        flood.append(asyncio.create_task(attacker("shared")))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt("shared"))
        await collect(engine.generate([65, 66], params, cache_salt="victim"))
        waited = time.perf_counter() - t0
        await asyncio.gather(*flood)
    finally:
        engine.shutdown()
    assert waited < 2 * SLOW_S, waited  # one slow compile at most (7 before)
