"""Requests a tenant abandons while their response formats wait to compile (engine/compile_queue.py, `join`): the
compiles leave the queue, so that the tenant's places and the compile threads are not held for no one."""

from __future__ import annotations

import asyncio
import time

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, ScriptedRunner, collect
from tests.engine.test_grammar_isolation import SLOW_S, FakeCompiles, fmt


async def test_a_tenants_abandoned_requests_free_its_compile_places_and_never_compile() -> None:
    """A tenant sends as many new slow schemas as it has places in the queue (the first compiles, the others wait:
    one compile a tenant at a time) and disconnects from every request: its next request is not refused, compiles as
    soon as the running one ends, and the waiting ones never compile. At HEAD: refused (429) until all had run."""
    engine = LLMEngine(ScriptedRunner(), CharTokenizer())
    compiles = FakeCompiles(engine)
    engine.start()
    try:
        def request(title: str) -> asyncio.Task[tuple[str, object]]:
            params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt(title))
            return asyncio.create_task(collect(engine.generate([65, 66], params, cache_salt="attacker")))

        abandoned = [request(f"slow{i}") for i in range(engine.compiles.per_tenant)]
        await asyncio.sleep(0.05)  # slow0 compiles, the others wait
        t0 = time.perf_counter()
        for task in abandoned:
            task.cancel()
        await asyncio.gather(*abandoned, return_exceptions=True)
        text, last = await request("next")
        waited = time.perf_counter() - t0
        await asyncio.sleep(SLOW_S)  # had they stayed queued, the abandoned compiles would run now
    finally:
        engine.shutdown()
    assert text == "Pa" and last.error is None  # type: ignore[attr-defined]
    assert waited < SLOW_S, waited  # behind slow0 alone, which was running
    assert sorted(compiles.done) == ["next", "slow0"]  # slow1.. never compiled
    assert engine.compiles.num_refused == 0 and not engine._compiling
