"""A speculative step isolates its sequences as a plain step does: one whose sampling raises fails alone.

The speculative decoder draws each sequence's draft and target tokens itself (engine/speculative.py), outside the
model runner's per-sequence isolation; an exception there failed every sequence of the step, as a failed forward
pass does. The fault is injected (the sampler raising for one request), not found in a model's quirks. So is NaN
in the logits: in the target's, it fails its sequence alone, as in a plain step; in the draft's, it ends that
sequence's draft and the target decides, its output still the target's distribution.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig, SpeculativeDecoder
from tests.engine.fakes import CharTokenizer, collect
from tests.engine.speculative_runners import (
    CHI2_4DOF_P001,
    DRAFT_CHAIN,
    TARGET_CHAIN,
    ChainRunner,
    ConstantRunner,
    P,
    chi2,
    decode,
)

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


# ---- NaN in the logits ----


class NaNFrom(ConstantRunner):
    """ConstantRunner whose rows at positions from `nan_from` on are NaN (a numeric fault in the forward pass)."""

    def __init__(self, probs: torch.Tensor, chain: dict[int, int] | None, nan_from: int) -> None:
        super().__init__(probs, chain)
        self.nan_from = nan_from

    def logits_of_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                       wanted: list[int]) -> torch.Tensor:
        out = super().logits_of_rows(token_ids, positions, block_tables, wanted)
        for r, w in enumerate(wanted):
            if positions[w] >= self.nan_from:
                out[r] = float("nan")
        return out


def one_step(target: ConstantRunner, draft: ConstantRunner, params: SamplingParams) -> tuple[SpeculativeDecoder,
                                                                                            list[list[int]]]:
    """One speculative step of `a` (3 prompt tokens) and `b` (40): b's rows are at positions 39 and on, a's below 10."""
    spec = SpeculativeDecoder(target, draft, SpeculativeConfig(k=4, max_batch=2, costs=None))
    blocks = BlockManager(4096, 16)
    seqs = [Sequence("a", [1, 2, 3], params), Sequence("b", [1 + i % 4 for i in range(40)], params)]
    for seq in seqs:
        blocks.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    made = spec.run(SchedulerOutput(seqs, [1, 1], [True, True]), blocks, max_model_len=1 << 20)
    assert made is not None
    return spec, made


SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=100)
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_nan_in_the_targets_logits_fails_its_sequence_alone(params: SamplingParams) -> None:
    """b's verification rows hold NaN: it makes no token and is named in `last_errors` (the engine fails it with
    engine_error); a makes exactly the tokens of a clean step. Before, argmax or the draw picked an arbitrary index
    from the NaN row (0, or the vocabulary's last) and b went on with it."""
    chain = TARGET_CHAIN if params.temperature == 0.0 else None
    _, clean = one_step(ConstantRunner(P, chain), ConstantRunner(P, DRAFT_CHAIN if chain else None), params)
    spec, made = one_step(NaNFrom(P, chain, nan_from=30), ConstantRunner(P, DRAFT_CHAIN if chain else None), params)
    assert made == [clean[0], []]
    assert set(spec.last_errors) == {"b"} and "NaN" in spec.last_errors["b"]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_nan_in_the_drafts_logits_ends_its_draft_and_the_target_decides(params: SamplingParams) -> None:
    """b's draft rows hold NaN from its second draft token on: b drafts one token, the target checks it and draws the
    next, and nothing fails; a drafts its 4. Before, the NaN row's argmax or draw was proposed as a draft token (and
    three more drafted after it), kept or refused by NaN arithmetic."""
    chain = TARGET_CHAIN if params.temperature == 0.0 else None
    spec, made = one_step(ConstantRunner(P, chain), NaNFrom(P, chain, nan_from=40), params)
    assert spec.last_errors == {} and spec.num_draft_tokens == 4 + 1
    assert 1 <= len(made[1]) <= 2 and len(made[0]) >= 1
    if chain is not None:  # the draft is the target: a keeps its 4, b its 1, each then makes the target's next
        assert made == [[TARGET_CHAIN[p] for p in range(3, 8)], [TARGET_CHAIN[p] for p in range(40, 42)]]
    assert spec._tallies["b"][0] == 4  # its 3 unproposed count as drafted and refused: drafting stops paying for it


def test_a_draft_whose_logits_are_nan_leaves_the_output_the_targets_distribution() -> None:
    """A draft whose rows are NaN from position 4 on (its third round of the first step) proposes 2 tokens in the
    first step and none after: every step is speculative (the draft keeps up with the sequence, reading its tokens
    once), nothing fails, and the tokens are drawn from the target's p."""
    draft = NaNFrom(P, None, nan_from=4)
    spec = SpeculativeDecoder(ConstantRunner(P), draft, SpeculativeConfig(k=4, costs=None))
    steps = decode(spec, SamplingParams(temperature=1.0, seed=9, max_tokens=1 << 20), 2000)
    assert spec.num_draft_tokens == 2 and spec.last_errors == {} and all(len(s) == 1 for s in steps[1:])
    assert draft.rows < 2000 + 10
    counts = torch.bincount(torch.tensor([t for s in steps for t in s]), minlength=5).float()
    assert chi2(counts, P) < CHI2_4DOF_P001, counts


class InfFrom(NaNFrom):
    """NaNFrom's rows at +inf instead: the sampling rule's shift makes them NaN (inf - inf), which no NaN check of the
    logits sees."""

    def logits_of_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                       wanted: list[int]) -> torch.Tensor:
        out = ConstantRunner.logits_of_rows(self, token_ids, positions, block_tables, wanted)
        for r, w in enumerate(wanted):
            if positions[w] >= self.nan_from:
                out[r] = float("inf")
        return out


def test_a_draft_row_its_sampling_cannot_read_ends_the_draft_and_fails_nothing() -> None:
    """b's draft rows are +inf from its second draft token on: as with NaN, b drafts one token and the target decides,
    and nothing fails. Before, b proposed three more tokens drawn from a NaN distribution (the vocabulary's last), each
    then kept or refused by NaN arithmetic against the target's p."""
    spec, made = one_step(ConstantRunner(P, None), InfFrom(P, None, nan_from=40), SAMPLED)
    assert spec.last_errors == {} and spec.num_draft_tokens == 4 + 1
    assert 1 <= len(made[1]) <= 2 and len(made[0]) >= 1
