"""Speculative decoding's acceptance rule, on model-free runners whose distributions are known.

The rule must leave the output distributed exactly as the target's sampling would (whatever the draft), keep
drafts at the rate sum_x min(p(x), q(x)), and turn greedy drafts into the target's own greedy chain; and it applies
only where a plain step would sample as it does. These tests draft whenever the rule can (`costs=None`); a long
prompt's catch-up is tests/engine/test_speculative_catch_up.py, when drafting pays tests/engine/test_draft_cost.py
and tests/engine/test_speculative_pays.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig, SpeculativeDecoder
from tests.engine.speculative_runners import (
    CHI2_4DOF_P001,
    ConstantRunner,
    P,
    Q,
    chi2,
    decode,
)


def test_sampled_output_is_the_targets_distribution_whatever_the_draft() -> None:
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(Q), SpeculativeConfig(k=3, costs=None))
    steps = decode(spec, SamplingParams(temperature=1.0, seed=7, max_tokens=1 << 20), 3000)
    first = torch.bincount(torch.tensor([s[0] for s in steps]), minlength=5).float()
    every = torch.bincount(torch.tensor([t for s in steps for t in s]), minlength=5).float()
    # without the residual draw the first token would follow min(p, q) + ..., far from p: chi2 in the hundreds
    assert chi2(first, P) < CHI2_4DOF_P001, first
    assert chi2(every, P) < CHI2_4DOF_P001, every
    assert every.sum() > 3000 * 1.5  # several tokens a step on average
    # each draft is kept with probability a = sum_x min(p(x), q(x)) = 0.55 once those before it were, so a step
    # keeps a + a^2 + a^3 of its 3 on average
    a = float(torch.minimum(P, Q).sum())
    rate = spec.num_accepted_tokens / spec.num_draft_tokens
    assert abs(rate - (a + a ** 2 + a ** 3) / 3) < 0.02, rate


def test_a_draft_equal_to_the_target_is_always_kept() -> None:
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(P), SpeculativeConfig(k=4, costs=None))
    steps = decode(spec, SamplingParams(temperature=1.0, seed=3, max_tokens=1 << 20), 200)
    assert all(len(s) == 5 for s in steps)
    assert spec.num_accepted_tokens == spec.num_draft_tokens == 800


def test_temperature_and_top_k_shape_both_distributions() -> None:
    """Under top_k=2 the output only ever holds the target's two likeliest tokens, at their renormalised odds."""
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(Q), SpeculativeConfig(k=2, costs=None))
    steps = decode(spec, SamplingParams(temperature=1.0, top_k=2, seed=11, max_tokens=1 << 20), 2000)
    tokens = torch.tensor([t for s in steps for t in s])
    assert set(tokens.tolist()) <= {0, 1}
    share = float((tokens == 0).float().mean())
    assert abs(share - 0.40 / 0.65) < 0.03, share


def test_greedy_drafts_give_the_targets_greedy_chain() -> None:
    target_chain = {p: (3 * p + 1) % 5 for p in range(1, 400)}
    draft_chain = {p: t if p % 4 else (t + 1) % 5 for p, t in target_chain.items()}  # wrong at every 4th position
    spec = SpeculativeDecoder(ConstantRunner(P, target_chain), ConstantRunner(P, draft_chain),
                              SpeculativeConfig(k=4, costs=None))
    steps = decode(spec, SamplingParams(temperature=0.0, max_tokens=1 << 20), 60)
    made = [t for s in steps for t in s]
    assert made == [target_chain[p] for p in range(3, 3 + len(made))]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_k_never_passes_max_tokens() -> None:
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(P), SpeculativeConfig(k=4, costs=None))
    steps = decode(spec, SamplingParams(temperature=1.0, seed=1, max_tokens=7), 2)
    assert [len(s) for s in steps] == [5, 2]  # 5, then the 2 left: never a token past max_tokens


def test_what_it_does_not_apply_to() -> None:
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(P), SpeculativeConfig(k=2, max_batch=2, costs=None))
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(temperature=0.0)) for i in range(3)]
    assert spec.applies(SchedulerOutput(seqs[:2], [1, 1], [True, True]))
    assert not spec.applies(SchedulerOutput(seqs, [1, 1, 1], [True] * 3))  # above max_batch
    assert not spec.applies(SchedulerOutput(seqs[:1], [2], [True]))  # a prompt chunk
    assert not spec.applies(SchedulerOutput([Sequence("l", [1, 2], SamplingParams(logprobs=2))], [1], [True]))
    penalized = Sequence("p", [1, 2], SamplingParams(temperature=0.0, frequency_penalty=0.5))  # a plain step's sampler
    assert not spec.applies(SchedulerOutput([seqs[0], penalized], [1, 1], [True, True]))  # applies them
    assert not spec.applies(SchedulerOutput([], [], []))


def test_bad_config_and_another_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="k must be within"):
        SpeculativeConfig(k=0)
    with pytest.raises(ValueError, match="max_batch"):
        SpeculativeConfig(max_batch=0)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(ConstantRunner(P), ConstantRunner(torch.ones(7) / 7), SpeculativeConfig())


def test_no_room_in_the_targets_cache_means_a_plain_step() -> None:
    spec = SpeculativeDecoder(ConstantRunner(P), ConstantRunner(Q), SpeculativeConfig(k=4, costs=None))
    blocks = BlockManager(1, 16)
    seq = Sequence("r", list(range(14)), SamplingParams(temperature=0.0, max_tokens=100))
    blocks.allocate_slots(seq, 14)
    seq.num_computed_tokens = 13
    assert spec.run(SchedulerOutput([seq], [1], [True]), blocks, max_model_len=1 << 20) is None
