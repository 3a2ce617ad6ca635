"""Speculative decoding's acceptance rule, on model-free runners whose distributions are known.

The rule must leave the output distributed exactly as the target's sampling would (whatever the draft), keep
drafts at the rate sum_x min(p(x), q(x)), and turn greedy drafts into the target's own greedy chain. A long prompt's
catch-up is spread over steps, each within its bound, and changes no token (on a tiny real model too, whose draft K/V
caught up in shares are those of reading the prompt at once). These tests draft whenever the rule can (`costs=None`);
tests/engine/test_draft_cost.py tests when drafting pays.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.block_manager import BlockManager
from engine.draft_cost import DraftCosts
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import CATCH_UP_ROWS, DEFAULT_COSTS, SpeculativeConfig, SpeculativeDecoder
from tests.engine.driver import generate_greedy
from tests.engine.fakes import CharTokenizer, collect

P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])  # the target's next-token distribution, whatever the context
Q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.20])  # a poor draft's
CHI2_4DOF_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


class ConstantRunner:
    """A runner whose logits are the same for every row: log `probs`, or a greedy chain if `chain` is set."""

    def __init__(self, probs: torch.Tensor, chain: dict[int, int] | None = None) -> None:
        self.config = SimpleNamespace(vocab_size=len(probs))
        self.num_kv_blocks, self.block_size = 4096, 16
        self.sampler = Sampler()
        self.logprobs = probs.log()
        self.chain = chain  # position -> the argmax token there (greedy tests)
        self.rows = 0

    def logits_of_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                       wanted: list[int]) -> torch.Tensor:
        self.rows += len(token_ids)
        if self.chain is None:
            return self.logprobs.repeat(len(wanted), 1)
        out = torch.full((len(wanted), len(self.logprobs)), -5.0)
        for r, w in enumerate(wanted):
            out[r, self.chain[positions[w] + 1]] = 5.0  # the row at position p predicts the token at p + 1
        return out


class ChainRunner(ConstantRunner):
    """A greedy `chain` as an engine's runner: its plain steps (`run`) pick the chain's token as its rows do."""

    def __init__(self, chain: dict[int, int]) -> None:
        super().__init__(P, chain)
        self.max_model_len = 4096
        self.eos_token_ids: set[int] = set()
        self.last_logprobs: dict[str, Any] = {}
        self.last_errors: dict[str, str] = {}
        self.last_error_codes: dict[str, str] = {}
        self.last_grammar_limits: set[str] = set()

    def run(self, out: SchedulerOutput) -> list[int]:
        assert self.chain is not None
        return [self.chain[s.num_tokens] for s, sample in zip(out.seqs, out.do_sample, strict=True) if sample]

    def release(self, request_id: str) -> None:
        pass


TARGET_CHAIN = {p: (3 * p + 1) % 5 for p in range(1, 4000)}
DRAFT_CHAIN = {p: t if p % 4 else (t + 1) % 5 for p, t in TARGET_CHAIN.items()}  # wrong at every 4th position


def draft_rows_per_step(engine: LLMEngine, draft: Any) -> list[int]:
    """Record the rows the draft runs in each of the engine's steps (the loop calls `step` on the instance)."""
    rows: list[int] = []

    def step() -> bool:
        before = draft.rows
        ran = LLMEngine.step(engine)
        if ran:
            rows.append(draft.rows - before)
        return ran

    engine.step = step  # type: ignore[method-assign]
    return rows


def decode(spec: SpeculativeDecoder, params: SamplingParams, steps: int, prompt_len: int = 3) -> list[list[int]]:
    """Run `steps` speculative steps of one sequence the way the engine does; the tokens of each step."""
    blocks = BlockManager(4096, 16)
    seq = Sequence("r", list(range(prompt_len)), params)
    blocks.allocate_slots(seq, prompt_len)
    seq.num_computed_tokens = prompt_len - 1  # the prompt is in the cache but for its last token
    made = []
    for _ in range(steps):
        out = SchedulerOutput([seq], [1], [True])
        assert spec.applies(out)
        tokens = spec.run(out, blocks, max_model_len=1 << 20)
        assert tokens is not None
        made.append(tokens[0])
        seq.output_token_ids += tokens[0]
        seq.num_computed_tokens = seq.num_tokens - 1
    spec.release("r")
    return made


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


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


async def test_a_long_prompt_is_caught_up_a_bounded_share_a_step() -> None:
    """The draft reads a 1,500-token prompt over plain steps, never more than CATCH_UP_ROWS rows (and its k rows of
    drafting) in one step; then the sequence drafts, and its tokens are the plain engine's."""
    spec, rows = await decode_through_engines([1 + i % 4 for i in range(1500)],
                                              SamplingParams(temperature=0.0, max_tokens=60), costs=None)
    assert max(rows) <= CATCH_UP_ROWS + 4, rows  # before the bound: the whole prompt (1,500 rows) in one step
    catching_up = [n for n in rows if n > 4]
    assert len(catching_up) > 1500 // CATCH_UP_ROWS  # shares over plain steps, fewer rows late in the prompt
    assert catching_up[-2] < catching_up[0]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens and spec.num_steps < 60
    assert sum(rows) < 1500 + 5 * 60  # each prompt token read once


def test_a_sequence_catching_up_decodes_beside_one_that_drafts() -> None:
    """With max_batch 2, a short sequence drafts every step while a long one beside it catches up; both make the
    target's greedy chain."""
    draft = ConstantRunner(P, DRAFT_CHAIN)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=2, costs=None))
    blocks = BlockManager(4096, 16)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    short, long = Sequence("s", [1, 2, 3], params), Sequence("l", [1 + i % 4 for i in range(1200)], params)
    for seq in (short, long):
        blocks.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    both_drafted = False
    for _ in range(40):
        rows, drafted = draft.rows, spec.num_draft_tokens
        made = spec.run(SchedulerOutput([short, long], [1, 1], [True, True]), blocks, max_model_len=1 << 20)
        assert made is not None  # the short one drafts: a speculative step
        assert draft.rows - rows <= CATCH_UP_ROWS + 2 * 4
        assert spec.num_draft_tokens - drafted >= 4  # the short one's 4, every step
        both_drafted |= spec.num_draft_tokens - drafted == 8
        for seq, tokens in zip((short, long), made, strict=True):
            seq.output_token_ids += tokens
            seq.num_computed_tokens = seq.num_tokens - 1
    assert both_drafted
    for seq in (short, long):
        assert seq.output_token_ids == [TARGET_CHAIN[p] for p in range(seq.num_prompt_tokens, seq.num_tokens)]


def test_a_real_drafts_kv_caught_up_in_shares_is_as_if_read_at_once(tiny_llama: Path) -> None:
    """A tiny model drafting for itself catches a 200-token prompt up over plain steps, within the bound a step: its
    K/V are those of reading the prompt at once, and the tokens are plain greedy decoding's."""
    def runner() -> ModelRunner:
        return ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)

    target, draft, reference = runner(), runner(), runner()
    spec = SpeculativeDecoder(target, draft, SpeculativeConfig(k=4, max_batch=1, costs=None))
    prompt = [(7 * i) % 120 + 5 for i in range(200)]
    seq = Sequence("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    blocks = BlockManager(target.num_kv_blocks, target.block_size)
    blocks.allocate_slots(seq, 200)
    seq.output_token_ids += target.run(SchedulerOutput([seq], [200], [True]))  # the prompt, as plain steps read it
    seq.num_computed_tokens = 200
    rows: list[int] = []
    logits_of_rows = draft.logits_of_rows

    def counted(token_ids: list[int], *args: Any) -> torch.Tensor:
        rows.append(len(token_ids))
        return logits_of_rows(token_ids, *args)

    draft.logits_of_rows = counted  # type: ignore[method-assign]
    plain_steps, step_rows = 0, []
    while seq.num_output_tokens < 40:
        blocks.allocate_slots(seq, 1)
        out, before = SchedulerOutput([seq], [1], [True]), len(rows)
        made = spec.run(out, blocks, max_model_len=target.max_model_len)
        if made is None:
            made, plain_steps = [target.run(out)], plain_steps + 1
        step_rows.append(sum(rows[before:]))
        seq.output_token_ids += made[0][:40 - seq.num_output_tokens]
        seq.num_computed_tokens = seq.num_tokens - 1
    assert max(step_rows) <= CATCH_UP_ROWS + 4, step_rows
    assert plain_steps >= 2 and spec.num_steps > 0  # two shares, then it drafts
    # the draft's K/V of the prompt, caught up in shares, against reading it in one call
    ref_blocks = BlockManager(reference.num_kv_blocks, reference.block_size)
    ref_seq = Sequence("ref", list(prompt), seq.params)
    ref_blocks.allocate_slots(ref_seq, 200)
    reference.logits_of_rows(prompt, list(range(200)), [ref_seq.block_table] * 200, [199])

    def kv(runner: ModelRunner, table: list[int]) -> torch.Tensor:
        bs = runner.block_size
        return torch.stack([runner.kv_cache[:, :, table[p // bs], p % bs] for p in range(200)])

    torch.testing.assert_close(kv(draft, spec._states["r"].block_table), kv(reference, ref_seq.block_table))
    expected, _ = generate_greedy(runner(), [prompt], 40)
    assert seq.output_token_ids == expected[0]


async def decode_through_engines(prompt: list[int], params: SamplingParams,
                                 draft_chain: dict[int, int] = DRAFT_CHAIN,
                                 costs: DraftCosts | None = DEFAULT_COSTS) -> tuple[SpeculativeDecoder, list[int]]:
    """One request through a plain engine and a speculative one (`costs`: the decoder's cost model, None to draft
    whenever it can); asserts both made the target's greedy chain; the decoder and the rows its draft read in each
    step."""
    plain = LLMEngine(ChainRunner(TARGET_CHAIN), CharTokenizer())
    draft = ConstantRunner(P, draft_chain)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=1, costs=costs))
    engine = LLMEngine(spec.target, CharTokenizer(), speculative=spec)
    rows = draft_rows_per_step(engine, draft)
    for e in (plain, engine):
        e.start()
    try:
        (text, last), (expected, _) = [await collect(e.generate(prompt, params)) for e in (engine, plain)]
    finally:
        for e in (plain, engine):
            e.shutdown()
    n = len(prompt)
    assert text == expected == "".join(chr(TARGET_CHAIN[p]) for p in range(n, n + params.max_tokens)
                                       if TARGET_CHAIN[p])
    assert last.num_output_tokens == params.max_tokens
    return spec, rows


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
