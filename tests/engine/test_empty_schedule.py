"""The model runner on an empty schedule (no sequence scheduled): nothing to compute, nothing returned.

The engine's loop never hands it one (LLMEngine.step returns before the runner when `out.is_empty`), but other
callers do (bench/engine_profile.py's loop did): the old runner built its input ids as `torch.tensor([])`, a float
tensor, and the embedding (or the native decode step) raised on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from tests.engine.driver import generate_greedy


def test_an_empty_schedule_returns_nothing_and_leaves_the_last_steps_results(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22)
    kv_before = runner.kv_cache.clone()
    assert runner.run(SchedulerOutput()) == []
    assert torch.equal(runner.kv_cache, kv_before)  # no row written
    assert runner.last_errors == {} and runner.last_logprobs == {}
    # and the runner still serves a real step after it
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    [out], _ = generate_greedy(runner, [[1, 5, 9]], 3, params=params)
    assert len(out) == 3
    assert runner.run(SchedulerOutput()) == []
    assert runner.last_logprobs == {}  # an empty step's results: none (not the step before's)


def test_rows_of_no_tokens_give_no_logits(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22)
    logits = runner.logits_of_rows([], [], [], [])
    assert logits.shape == (0, runner.config.vocab_size)
