"""A caller whose event loop has closed costs only its own outputs: the engine loop thread serves on.

The engine hands each output to its caller's loop with `call_soon_threadsafe`, which raises RuntimeError once that
loop is closed. A loop can close between any check and the call, so the fault is injected as a loop that says it is
open and raises as a closed one does; raised in the engine's thread, the error ended the loop, failing every request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, FaultyRunner, collect

GREEDY = SamplingParams(temperature=0, max_tokens=64)


class ClosedLoop:
    """An event loop that closed after the engine's last look: it says it is open, and refuses the call."""

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, *args: Any) -> None:
        raise RuntimeError("Event loop is closed")


def test_a_closed_loop_refuses_the_call_as_the_stand_in_does() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.call_soon_threadsafe(print)


async def test_a_caller_whose_loop_closed_is_dropped_and_the_others_finish() -> None:
    """Two departed callers, one streaming and one whose request fails (its error sent from inside an `except`),
    beside a live one in every step: the live one gets its whole answer, the departed ones' requests stop and free
    their blocks, and the engine serves on."""
    runner = FaultyRunner()
    eng = LLMEngine(runner, CharTokenizer(), max_num_seqs=4)
    tasks = {p: asyncio.ensure_future(collect(eng.generate([ord(c) for c in p], GREEDY, request_id=p)))
             for p in ("live", "gone", "gone SAMPLE-FAIL")}
    await asyncio.sleep(0.05)  # all registered and queued before the loop starts: they share its first step
    for rid in ("gone", "gone SAMPLE-FAIL"):
        eng.handoff.sinks[rid].loop = ClosedLoop()  # type: ignore[assignment]
    eng.start()
    try:
        text, last = await asyncio.wait_for(tasks["live"], 5)
        assert text == "Paris is the capital." and last.error is None and eng.dead_reason is None
        for _ in range(100):  # the departed streaming one is aborted at the next step
            if eng.stats().num_kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats().num_kv_blocks_used == 0 and eng.handoff.sinks == {}
        assert set(runner.released) == {"live", "gone", "gone SAMPLE-FAIL"}
        assert sum(1 for s in runner.steps for q in s.seqs if q.request_id == "gone") < 5  # stopped, not run out
        text, _ = await asyncio.wait_for(collect(eng.generate([ord(c) for c in "again"], GREEDY)), 5)
        assert text == "Paris is the capital."
    finally:
        for task in tasks.values():
            task.cancel()
        eng.shutdown()
