"""A sequence whose logits hold NaN fails alone: its token would be noise (argmax and the sampler's draw both pick
an arbitrary index from NaN), so the model runner fails it as it fails a sampler that raises, and the others of the
batch keep exactly the tokens they would have made. The fault is injected into one row of the logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


# the whole row NaN, or one entry of it (the runner reads a row's NaN where argmax puts its maximum: anywhere)
@pytest.mark.parametrize("where", [slice(None), 0, 17, -1], ids=["row", "first", "one", "last"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_of_nan_logits_fails_its_sequence_alone(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                      temperature: float, where: Any) -> None:
    def first_step(nan_row: int | None) -> tuple[list[int], ModelRunner]:
        runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)
        sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=runner.max_model_len, eos_token_ids=set())
        for rid in ("a", "b", "c"):
            sched.add_request(Sequence(rid, [1, 2, 3, 4], SamplingParams(temperature=temperature, seed=7,
                                                                         max_tokens=4)))
        logits_of = runner.model.compute_logits

        def with_nan(hidden: Any) -> torch.Tensor:
            logits = logits_of(hidden)
            if nan_row is not None:
                logits[nan_row, where] = float("nan")
            return logits

        monkeypatch.setattr(runner.model, "compute_logits", with_nan)
        return runner.run(sched.schedule()), runner

    clean, _ = first_step(None)
    tokens, runner = first_step(1)
    assert tokens == [clean[0], -1, clean[2]]
    assert set(runner.last_errors) == {"b"} and "NaN" in runner.last_errors["b"]
    assert runner.last_error_codes == {}  # the engine's failure, not the request's
