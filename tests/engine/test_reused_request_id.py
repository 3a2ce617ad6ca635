"""A request id used again right after its request ended names only the new request: an abort meant for the old one
never cancels it. The server gives every request a uuid4; a direct caller of the engine may reuse ids.

An abort is taken for the request living under the id when it is asked for, and applied only to that request: before,
the engine kept the id alone, so an abort still pending when the old request finished (or asked for by the old
caller's stream after it ended) cancelled the new one. The engine's steps are driven by hand here, in order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, ScriptedRunner, collect


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def drive(eng: LLMEngine, task: asyncio.Future[Any]) -> Any:
    """Step the engine (its loop thread is not started) until `task` is done."""
    for _ in range(100):
        await asyncio.sleep(0)  # the task runs first: a new request registers before the step drains the inbox
        if task.done():
            return task.result()
        eng.step()
    raise AssertionError("the request never finished")


async def test_an_abort_pending_when_a_request_finished_spares_the_new_request_under_its_id() -> None:
    runner = ScriptedRunner()
    eng = LLMEngine(runner, CharTokenizer())
    old = asyncio.ensure_future(collect(eng.generate(ids("old"), SamplingParams(temperature=0, max_tokens=1),
                                                     request_id="x")))
    await asyncio.sleep(0)
    run = runner.run

    def leaving_during_the_step(out: Any) -> list[int]:
        eng.abort("x")  # the old caller leaves while its last token is made
        return run(out)

    runner.run = leaving_during_the_step  # type: ignore[method-assign]
    eng.step()
    runner.run = run  # type: ignore[method-assign]
    _, last = await old
    assert last.finish_reason == "length"  # it finished in that step: the abort is left pending
    new = asyncio.ensure_future(collect(eng.generate(ids("new"), SamplingParams(temperature=0, max_tokens=3),
                                                     request_id="x")))
    text, last = await drive(eng, new)
    assert (text, last.finish_reason) == ("Par", "length")


async def test_an_old_stream_closed_after_its_request_ended_spares_the_new_request_under_its_id() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer())
    old = eng.generate(ids("old"), SamplingParams(temperature=0, max_tokens=2), request_id="x")
    first = asyncio.ensure_future(anext(old))
    await asyncio.sleep(0)
    eng.step()
    assert not (await first).finished
    eng.step()  # the old request finishes in the engine; its last output waits unread in its caller's queue
    new = asyncio.ensure_future(collect(eng.generate(ids("new"), SamplingParams(temperature=0, max_tokens=3),
                                                     request_id="x")))
    await asyncio.sleep(0)  # registered under "x"
    await old.aclose()  # the old caller leaves without reading its last output: its stream aborts its request
    text, last = await drive(eng, new)
    assert (text, last.finish_reason) == ("Par", "length")


async def test_an_abort_by_id_still_cancels_the_request_living_under_it() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer())
    req = asyncio.ensure_future(collect(eng.generate(ids("one"), SamplingParams(temperature=0, max_tokens=10),
                                                     request_id="x")))
    await asyncio.sleep(0)
    eng.step()
    eng.abort("x")
    text, last = await drive(eng, req)
    assert (text, last.finish_reason) == ("P", "abort") and eng.stats().num_kv_blocks_used == 0
