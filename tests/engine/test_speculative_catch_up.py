"""A long prompt's catch-up in the draft: spread over plain steps, each within its bound (CATCH_UP_ROWS), beside
sequences that draft, and changing no token (on a tiny real model too, whose draft K/V caught up in shares are those
of reading the prompt at once). These tests draft whenever the rule can (`costs=None`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import CATCH_UP_ROWS, SpeculativeConfig, SpeculativeDecoder
from tests.engine.driver import generate_greedy
from tests.engine.speculative_runners import (
    DRAFT_CHAIN,
    TARGET_CHAIN,
    ChainRunner,
    ConstantRunner,
    P,
    decode_through_engines,
)


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
