"""The engine loop with a scripted runner: stop, length, stop strings, abort, priority, usage."""

from __future__ import annotations

import asyncio

import pytest

from engine.llm_engine import EngineInputError, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, ScriptedRunner, collect

GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture
def engine():  # type: ignore[no-untyped-def]
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=2)
    eng.start()
    yield eng
    eng.shutdown()


async def test_generates_until_eos_and_counts_tokens(engine: LLMEngine) -> None:
    text, last = await collect(engine.generate([1, 2, 3], GREEDY))
    assert text == "Paris is the capital." and last.finish_reason == "stop"
    assert last.num_prompt_tokens == 3 and last.num_output_tokens == len(text) + 1  # the EOS counts
    assert last.busy_s > 0
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_generation_tokens_total) == (0, 0, len(text) + 1)


async def test_max_tokens_and_stop_strings(engine: LLMEngine) -> None:
    text, last = await collect(engine.generate([1], SamplingParams(temperature=0, max_tokens=5)))
    assert (text, last.finish_reason, last.num_output_tokens) == ("Paris", "length", 5)
    text, last = await collect(engine.generate([1], SamplingParams(temperature=0, max_tokens=64, stop=[" the"])))
    assert (text, last.finish_reason) == ("Paris is", "stop")


async def test_too_long_requests_are_refused_up_front(engine: LLMEngine) -> None:
    with pytest.raises(EngineInputError, match="maximum context length is 256"):
        await collect(engine.generate(list(range(1, 200)), SamplingParams(max_tokens=100)))
    with pytest.raises(EngineInputError):
        await collect(engine.generate([], GREEDY))


async def test_leaving_the_stream_aborts_and_frees_the_sequence() -> None:
    runner = ScriptedRunner(step_s=0.01)
    eng = LLMEngine(runner, CharTokenizer())
    eng.start()
    try:
        gen = eng.generate([1], GREEDY, request_id="cancel-me")
        await anext(gen)
        await gen.aclose()
        assert eng.stats().num_kv_blocks_used == 1
        for _ in range(100):
            if "cancel-me" in runner.released:
                break
            await asyncio.sleep(0.01)
        stats = eng.stats()
        assert runner.released == ["cancel-me"] and stats.num_running == 0
        assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total
    finally:
        eng.shutdown()


async def test_waiting_requests_are_admitted_by_priority() -> None:
    runner = ScriptedRunner(reply="ab", step_s=0.01)
    eng = LLMEngine(runner, CharTokenizer(), max_num_seqs=1)
    eng.start()
    try:
        first = asyncio.ensure_future(collect(eng.generate([1], GREEDY, request_id="first")))
        await asyncio.sleep(0.005)
        low = asyncio.ensure_future(collect(eng.generate([1], GREEDY, request_id="low", priority=5)))
        high = asyncio.ensure_future(collect(eng.generate([1], GREEDY, request_id="high", priority=0)))
        await asyncio.gather(first, low, high)
        assert runner.order == ["first", "high", "low"]
    finally:
        eng.shutdown()


async def test_a_follow_up_turn_reuses_the_cached_prefix(engine: LLMEngine) -> None:
    history = [ord(c) for c in "<system>You are terse.<user>What is the capital of France?>"]
    _, first = await collect(engine.generate(history, GREEDY))
    assert first.num_cached_tokens == 0
    turn_2 = history + [ord(c) for c in "Paris is the capital.<user>And of Italy?>"]
    _, second = await collect(engine.generate(turn_2, GREEDY))
    # every full block of the first turn, its answer included: 59 prompt + 21 answer tokens = 5 blocks of 16
    assert second.num_cached_tokens == (len(history) + len("Paris is the capital.")) // 16 * 16 == 80
    stats = engine.stats()
    assert stats.num_prefix_hit_tokens_total == second.num_cached_tokens
    assert stats.prefix_cache_hit_rate == second.num_cached_tokens / (len(history) + len(turn_2))
    assert stats.num_kv_blocks_used == 0 and stats.generation_tokens_per_s > 0


async def test_a_tenant_holding_every_slot_does_not_hold_back_another_tenants_request() -> None:
    """Before, the victim's request waited for one of the attacker's 200-token answers to finish."""
    runner = ScriptedRunner(reply="x" * 200, step_s=0.002)
    eng = LLMEngine(runner, CharTokenizer(), max_num_seqs=2)
    eng.start()
    try:
        long = SamplingParams(temperature=0, max_tokens=250)
        attackers = [asyncio.ensure_future(collect(eng.generate([1, k], long, cache_salt="attacker")))
                     for k in (2, 3)]
        while eng.stats().num_running < 2:
            await asyncio.sleep(0.005)
        text, _ = await collect(eng.generate([5], SamplingParams(temperature=0, max_tokens=3), cache_salt="victim"))
        assert text == "xxx" and not any(a.done() for a in attackers)
        answers = await asyncio.gather(*attackers)
        assert [t for t, _ in answers] == ["x" * 200] * 2  # the preempted answer resumed where it was
        assert eng.stats().num_preemptions_total == 1
    finally:
        eng.shutdown()
