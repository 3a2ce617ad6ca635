"""A speculative step isolates its sequences as a plain step does: one whose sampling raises fails alone.

The speculative decoder draws each sequence's draft and target tokens itself (engine/speculative.py), outside the
model runner's per-sequence isolation; an exception there failed every sequence of the step, as a failed forward
pass does. The fault is injected (the sampler raising for one request), not found in a model's quirks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.llm_engine import LLMEngine
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig, SpeculativeDecoder
from tests.engine.fakes import CharTokenizer, collect
from tests.engine.test_speculative import DRAFT_CHAIN, TARGET_CHAIN, ChainRunner, ConstantRunner, P

BAD_SEED = 666


async def test_a_sequence_whose_sampling_fails_in_a_speculative_step_fails_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sampled requests share every speculative step (max_batch 2); the one whose sampling raises fails with
    `engine_error` (after its first token, made by the prompt's plain step), the other makes all its tokens, and no
    KV block stays held. Before, the decoder's exception failed every sequence of the step, as if the forward pass
    had failed."""
    distribution = Sampler.distribution

    def failing(logits: Any, params: SamplingParams) -> Any:
        if params.seed == BAD_SEED:
            raise ValueError("bad logits")
        return distribution(logits, params)

    monkeypatch.setattr(Sampler, "distribution", staticmethod(failing))
    draft = ConstantRunner(P, DRAFT_CHAIN)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=2, costs=None))
    eng = LLMEngine(spec.target, CharTokenizer(), speculative=spec)
    prompt = [1 + i % 4 for i in range(20)]
    tasks = [asyncio.ensure_future(collect(eng.generate(prompt, SamplingParams(temperature=0.7, seed=seed,
                                                                               max_tokens=30))))
             for seed in (1, BAD_SEED)]
    await asyncio.sleep(0.05)  # both queued before the loop starts: they share every step
    eng.start()
    try:
        (_, good), (_, bad) = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert good.error is None and good.num_output_tokens == 30
        assert spec.num_steps > 0  # the failure came in a speculative step
        assert (bad.finish_reason, bad.error_code) == ("error", "engine_error") and bad.num_output_tokens == 1
        assert "bad logits" in (bad.error or "")
        assert eng.stats().num_kv_blocks_used == 0 and spec.blocks.num_used_blocks == 0
        assert eng.stats().num_requests_failed == 1 and eng.dead_reason is None
    finally:
        eng.shutdown()
