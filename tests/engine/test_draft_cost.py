"""When drafting pays for a sequence (engine/draft_cost.py), with the speculative decoder's default costs."""

from __future__ import annotations

from engine.draft_cost import interpolate
from engine.speculative import CATCH_UP_CONTEXT, CATCH_UP_ROWS, DEFAULT_COSTS


def pays(context: int, left: int, *, read: int = 0, k: int = 4, drafted: int = 0, kept: int = 0,
         sampled: bool = False, batch: int = 1) -> bool:
    return DEFAULT_COSTS.pays(k=k, context=context, read=read, left=left, drafted=drafted, kept=kept, sampled=sampled,
                              batch=batch)


def test_the_catch_up_shares_are_the_decoders() -> None:
    assert (DEFAULT_COSTS.catch_up_rows, DEFAULT_COSTS.catch_up_context) == (CATCH_UP_ROWS, CATCH_UP_CONTEXT)


def test_a_long_prompt_does_not_pay_a_short_one_does() -> None:
    # the review's case: a 1,559-token prompt answered in 128 tokens took 6.8-7.2 s speculating, 4.4 s plainly
    assert not pays(1559, 128)
    assert not pays(1559, 128, sampled=True)
    assert not pays(1559, 1024)  # more tokens to make do not help: at that context a step costs more than it makes
    assert pays(60, 128) and pays(60, 128, sampled=True)
    assert pays(200, 128)


def test_a_short_answer_does_not_pay_for_its_catch_up() -> None:
    assert not pays(250, 4)
    assert pays(250, 256)
    assert pays(250, 4, read=249)  # caught up: only the saving counts


def test_a_caught_up_sequence_stops_where_a_step_costs_more_than_it_makes() -> None:
    assert pays(300, 64, read=299)
    assert not pays(1559, 64, read=1558)
    assert not pays(1, 1)  # nothing left to draft for
    assert not pays(60, 128, k=0)


def test_a_long_answer_counts_only_the_tokens_that_still_save() -> None:
    """Past ~1,200 tokens of context a step saves nothing (the sequence stops drafting there): a 400-token prompt
    with 2,000 tokens to make pays for its catch-up with the ~800 tokens before that, the rest counting for nothing
    (neither for nor against)."""
    assert pays(400, 2000) and pays(400, 800)
    assert not pays(1300, 2000, read=1299)


def test_the_sequences_own_acceptance_counts() -> None:
    assert pays(60, 128, read=59, drafted=40, kept=38)
    assert not pays(60, 128, read=59, drafted=40, kept=4)  # its drafts are refused: plain steps are cheaper


def test_the_cost_grows_with_what_is_left_to_read() -> None:
    """For a fixed answer length, a sequence pays below some prompt length and never above it; the more it may still
    make, the longer that prompt."""

    def longest_paying(left: int) -> int:
        paying = [n for n in range(2, 2000, 8) if pays(n, left)]
        assert paying == list(range(2, paying[-1] + 1, 8))  # one interval from the shortest prompts
        return paying[-1]

    assert longest_paying(16) < longest_paying(64) < longest_paying(256) < 1559


def test_in_a_batch_a_kept_draft_saves_less() -> None:
    """A plain step of 16 sequences costs about two of one (bench.draft_costs), their verification and draft rows
    about a row's compute each: at 16 streams drafting lost (0.53-0.62x of plain, BENCHMARKS.md). A caught-up short
    sequence keeping every draft pays alone and beside one other, not in a step of 4 or more."""
    caught_up = {"read": 59, "drafted": 400, "kept": 400}
    assert pays(60, 128, **caught_up) and pays(60, 128, batch=2, **caught_up)
    assert not any(pays(60, 128, batch=b, **caught_up) for b in (4, 8, 16, 32))
    assert pays(60, 128) and not pays(60, 128, batch=4)  # its catch-up too: none in a big batch


def test_a_step_drafts_only_if_it_costs_less_a_token_than_a_plain_one() -> None:
    def step_pays(num_seqs: int, num_drafting: int, kept: float = 0.9, context: int = 100) -> bool:
        seqs = [(context, 4 if i < num_drafting else 0, kept, False) for i in range(num_seqs)]
        return DEFAULT_COSTS.per_token(seqs) < DEFAULT_COSTS.per_token([(context, 0, kept, False)] * num_seqs)

    assert step_pays(1, 1) and step_pays(2, 2, kept=1.0)
    assert not step_pays(16, 16) and not step_pays(16, 16, kept=1.0) and not step_pays(4, 4)
    assert not step_pays(2, 1)  # the other sequence's plain token is cheap beside it: one drafting does not pay
    assert not step_pays(1, 1, kept=0.2) and not step_pays(1, 1, context=2000)


def test_interpolation_between_and_past_the_measured_rows() -> None:
    table = ((1, 1.0), (5, 2.0), (10, 3.0))
    assert [interpolate(table, n) for n in (1, 3, 5, 10, 20)] == [1.0, 1.5, 2.0, 3.0, 5.0]
