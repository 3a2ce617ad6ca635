"""Speculative decoding drafts only where it pays (the decoder's cost model, engine/draft_cost.py): a long
prompt's catch-up that cannot pay, a sequence whose drafts are refused, and steps of many sequences decode plainly;
a short prompt, and the last few of many, draft; a seeded sampled request judges at max_batch whatever runs beside
it. Every answer is the plain engine's."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import SpeculativeConfig, SpeculativeDecoder
from tests.engine.fakes import CharTokenizer, collect
from tests.engine.speculative_runners import (
    TARGET_CHAIN,
    ChainRunner,
    ConstantRunner,
    P,
    decode_through_engines,
)


async def test_a_long_prompt_whose_catch_up_cannot_pay_decodes_without_drafting() -> None:
    """1,500 prompt tokens for 60 answer tokens: the draft would read the prompt (spread over plain steps) to save a
    fraction of 60 plain steps; the sequence never drafts and the draft reads none of it (at HEAD: 1,500 rows read,
    then speculative steps)."""
    spec, rows = await decode_through_engines([1 + i % 4 for i in range(1500)],
                                              SamplingParams(temperature=0.0, max_tokens=60))
    assert sum(rows) == 0
    assert spec.num_steps == spec.num_draft_tokens == 0


async def test_a_short_prompt_still_drafts() -> None:
    spec, rows = await decode_through_engines([1 + i % 4 for i in range(20)],
                                              SamplingParams(temperature=0.0, max_tokens=60))
    assert spec.num_steps > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.num_steps < 60 // 2  # several tokens a step
    assert 19 <= sum(rows) < 20 + 5 * 60


async def test_a_sequence_whose_drafts_are_refused_stops_drafting() -> None:
    """A draft wrong at every position: after its first refused drafts, the sequence's own acceptance says drafting
    costs more than it saves, and it decodes plainly."""
    wrong = {p: (t + 1) % 5 for p, t in TARGET_CHAIN.items()}
    spec, _ = await decode_through_engines([1 + i % 4 for i in range(20)],
                                           SamplingParams(temperature=0.0, max_tokens=60), wrong)
    assert spec.num_accepted_tokens == 0
    assert 0 < spec.num_steps <= 2 and spec.num_draft_tokens <= 8


async def test_many_streams_take_plain_steps_and_the_last_few_draft() -> None:
    """16 greedy requests of different lengths, max_batch 16, a draft that is always right: while many run, a step
    costs less plainly (a plain step of 16 costs about two of one; 16 x 5 verification rows and 16-row draft rounds,
    far more), so they take plain steps and the draft reads none of their prompts; the longest, left alone, drafts.
    Every answer is the plain engine's. At HEAD each sequence judged as if alone: steps of 16 drafted."""
    prompts = [[1 + (i + j) % 4 for j in range(20)] for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i if i < 15 else 120) for i in range(16)]
    plain = LLMEngine(ChainRunner(TARGET_CHAIN), CharTokenizer(), max_num_seqs=16)
    draft = ConstantRunner(P, TARGET_CHAIN)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=16))
    engine = LLMEngine(spec.target, CharTokenizer(), max_num_seqs=16, speculative=spec)
    batches: list[int] = []  # sequences in each speculative step
    verify = spec._verify

    def recorded(plans: list[Any]) -> list[list[int]]:
        batches.append(len(plans))
        return verify(plans)

    spec._verify = recorded  # type: ignore[method-assign]
    for e in (plain, engine):
        e.start()
    try:
        answers = [await asyncio.gather(*(collect(e.generate(p, q)) for p, q in zip(prompts, params, strict=True)))
                   for e in (plain, engine)]
    finally:
        for e in (plain, engine):
            e.shutdown()
    assert [text for text, _ in answers[1]] == [text for text, _ in answers[0]]
    assert batches and max(batches) <= 2, batches
    assert draft.rows < 2 * 20 + 4 * 120  # the prompts of the last two at most, then their drafts


def test_a_step_drafts_only_where_it_pays_for_the_batch() -> None:
    """Run directly: one sequence drafts; the same sequences sixteen to a step, none do (nor catch up)."""
    draft = ConstantRunner(P, TARGET_CHAIN)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=16))
    blocks = BlockManager(4096, 16)
    seqs = [Sequence(f"r{i}", [1 + (i + j) % 4 for j in range(20)], SamplingParams(temperature=0.0, max_tokens=64))
            for i in range(16)]
    for seq in seqs:
        blocks.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    assert spec.run(SchedulerOutput(seqs, [1] * 16, [True] * 16), blocks, max_model_len=1 << 20) is None
    assert draft.rows == 0 and spec.num_steps == 0
    made = spec.run(SchedulerOutput(seqs[:1], [1], [True]), blocks, max_model_len=1 << 20)
    assert made is not None and len(made[0]) == 5


def test_a_seeded_sampled_request_judges_at_max_batch_whatever_runs_beside_it() -> None:
    """Its numbers are drawn in an order that depends on how it drafts, so it judges as if its steps held max_batch
    sequences: alone at max_batch 1, it drafts; at max_batch 16, where 16 would lose, it never does, alone or beside
    others; an unseeded one alone still drafts."""
    seeded, unseeded = (SamplingParams(temperature=0.8, seed=s, max_tokens=64) for s in (5, None))

    def drafted(max_batch: int, params: list[SamplingParams]) -> list[bool]:
        spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), ConstantRunner(P, TARGET_CHAIN),
                                  SpeculativeConfig(k=4, max_batch=max_batch))
        blocks = BlockManager(4096, 16)
        seqs = [Sequence(f"r{i}", [1 + (i + j) % 4 for j in range(20)], p) for i, p in enumerate(params)]
        for seq in seqs:
            blocks.allocate_slots(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens - 1
        made = spec.run(SchedulerOutput(seqs, [1] * len(seqs), [True] * len(seqs)), blocks, max_model_len=1 << 20)
        return [made is not None and len(tokens) > 1 for tokens in made or [[]] * len(seqs)]

    assert drafted(1, [seeded]) == [True]
    assert drafted(16, [seeded]) == [False] and drafted(16, [unseeded]) == [True]
    assert drafted(16, [seeded] + [unseeded] * 15) == [False] * 16
