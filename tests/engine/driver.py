"""Drive scheduler + block manager + a runner step by step (no engine thread), and compare with a reference."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

NEAR_TIE = 1e-4  # top-2 logit gap in the reference below which a different greedy pick is allowed


def generate_greedy(runner: Any, prompts: list[list[int]], max_tokens: int, *, arrivals: list[int] | None = None,
                    max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                    num_kv_blocks: int | None = None, params: SamplingParams | None = None,
                    ) -> tuple[list[list[int]], Scheduler]:
    """Greedy outputs per prompt, and the scheduler; prompt i joins at step `arrivals[i]`. `params`: each request's
    (plain greedy to `max_tokens`, EOS ignored, by default)."""
    bm = BlockManager(num_kv_blocks or runner.num_kv_blocks, runner.block_size)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=runner.max_model_len, eos_token_ids=set())
    arrivals = arrivals or [0] * len(prompts)
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [Sequence(f"r{i}", p, params, arrival_time=float(i)) for i, p in enumerate(prompts)]
    step = 0
    while step <= max(arrivals) or sched.has_unfinished_requests():
        for seq, at in zip(seqs, arrivals, strict=True):
            if at == step:
                sched.add_request(seq)
        out = sched.schedule()
        if not out.is_empty:
            sched.postprocess(out, runner.run(out))
        step += 1
    assert bm.num_free_blocks == bm.num_blocks
    return [s.output_token_ids for s in seqs], sched


def assert_same_or_near_tie(ref: Any, prompt: list[int], ours: list[int], expected: list[int]) -> None:
    """Equal token for token, or diverging first where the reference's top two logits nearly tie."""
    if ours == expected:
        return
    t = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + expected[:t]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at output token {t} with a reference top-2 gap of {gap:.2e}: {ours} != {expected}"
    warnings.warn(f"near-tie divergence at output token {t} (gap {gap:.1e})", stacklevel=2)


def assert_reference_greedy(ref: Any, prompt: list[int], ours: list[int]) -> None:
    """`ours` is the reference's greedy continuation of `prompt`, checked in one forward pass over prompt + ours
    (teacher-forced) instead of the reference's own generate (a forward per token): at every step our token is
    the reference's top one given the prompt and our tokens before it, so by induction the two sequences are
    equal. A step may differ only where the reference's top two nearly tie and ours is one of them (reported);
    the tokens after it follow another context and are not compared."""
    with torch.no_grad():  # the logits of the last len(ours) positions: the prompt's last, then ours but the last
        logits = ref(torch.tensor([prompt + ours[:-1]]), logits_to_keep=len(ours)).logits[0]
    for t, (row, token) in enumerate(zip(logits, ours, strict=True)):
        top2 = torch.topk(row, 2)
        if int(top2.indices[0]) == token:
            continue
        gap, behind = float(top2.values[0] - top2.values[1]), float(top2.values[0] - row[token])
        assert gap < NEAR_TIE and behind < NEAR_TIE, (
            f"output token {t} is {token}, {behind:.2e} below the reference's top token {int(top2.indices[0])} "
            f"(top-2 gap {gap:.2e}): {ours}")
        warnings.warn(f"near-tie divergence at output token {t} (gap {gap:.1e})", stacklevel=2)
        return
