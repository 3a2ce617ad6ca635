"""Whether drafting pays, for a sequence and for the step it is in: the draft's catch-up and its speculative steps
against the plain steps they would save, in D0, a plain decode step of one sequence of the target at a short context.

A step of B decoding sequences, the i-th drafting k_i tokens at context c_i (k_i = 0: it only decodes its next
token), costs the target's step of sum(1 + k_i) single-token rows, T(rows) at a short context plus c_i /
decode_context for each sequence and c_i / verify_row_context for each of its k_i verification rows; and the draft's
rounds, round j one row for each sequence with k_i >= j, R(rows) plus R(1) c_i / draft_row_context a row (and, for a
sampled request, 2k_i more distributions). A plain step is the same with every k_i = 0: T(B). It makes B + sum k_i f_i
tokens on average, f_i being the share of its drafted tokens the sequence keeps; B plain tokens cost T(B). T and R
grow slowly at a few rows (a step reads the weights once) and then by about a row's compute a row, so the more
sequences a step holds, the less a plain token costs and the less a kept draft token saves: at k = 4 and 90% kept a
step of 1 sequence pays (0.81 D0 a token against 1), of 2 barely (0.48 against 0.51), of 3 or more not (16: 0.18
against 0.12; BENCHMARKS.md measured 16 streams drafting at 0.53-0.62x of plain).

So a step drafts only where its expected cost per token (`per_token`) is below a plain step's, for the sequences that
would draft in it (the decoder drafts for none otherwise; engine/speculative.py: but for seeded sampled requests, which
judge at max_batch). Which sequences would draft is each one's own judgement, `pays`, made at the step's number of
sequences B, as if every one of them drafted: a plain token costs the sequence T(B) / B, a speculative step its share
of the step, making E = 1 + k f tokens. So each token saves that share of a plain step minus the speculative share / E,
which falls as the context grows, and the tokens a sequence may still make (max_tokens left, or the context left) save
its sum over them, up to the context where it reaches 0 (there the sequence stops drafting). Against it: the draft's
catch-up, every token it has not read yet, a row read after c others costing catch_up_row (1 + c / catch_up_context),
and the tokens decoded plainly while the catch-up is spread over steps (engine/speculative.py: CATCH_UP_ROWS
start-of-prompt rows a step). A sequence drafts only while the saving exceeds that cost, so a long prompt whose
catch-up outweighs a short answer never drafts, at a context where a speculative step costs more than the tokens it
makes no sequence drafts even when caught up, and in a step of many sequences none drafts or catches up (later, in a
smaller batch, it may).

f is the sequence's own: its kept and drafted tokens so far, after PRIOR_DRAFTS tokens kept at PRIOR_KEPT (the int8
draft of `mid` kept 86-98% for `full` at one stream, BENCHMARKS.md). The decision depends on the sequence (its tokens,
max_tokens, the draft's progress on it and its own acceptance) and on the number of sequences in its steps; a seeded
sampled request judges as if its steps held max_batch (engine/speculative.py), so that it draws its numbers in the
same order whatever runs beside it.

The constants were measured on one core of an AMD EPYC (AVX-512 BF16, no AMX) with the `full` tier's target
(SmolLM2-135M, bf16) and draft (the same model int8), `.venv/bin/python -m bench.draft_costs` (median of 5; a second
run on a busier machine was 10-35% slower, each cost's ratio to D within 0.2 of this one's), D0 = 12.3 ms:

| context | plain decode D | 5 verification rows | one draft row | a catch-up row (128 a call) |
|---|---|---|---|---|
| 64 | 12.3 ms | 14.0 ms | 8.2 ms | 0.78 ms |
| 512 | 13.2 ms | 17.0 ms | 9.9 ms | 1.27 ms |
| 1,024 | 15.1 ms | 21.0 ms | 12.5 ms | 1.87 ms |
| 1,550 | 16.5 ms | 24.2 ms | 13.7 ms | 2.42 ms |

and a sampled distribution (T=0.8, top_p=0.95; engine/sampler.py) 0.2-0.4 ms; and by batch, at 64 tokens of context
each, in D0 (`bench.draft_costs 64`, three runs, their medians; D0 12.1-14.1 ms there, each call measured after another
model's):

| sequences B | plain step T(B) | draft round R(B) | target's 5B rows T(5B) (k = 4) |
|---|---|---|---|
| 1 | 0.97-0.99 | 0.61-0.62 | 1.10-1.12 |
| 2 | 1.02 | 0.71 | 1.48 |
| 4 | 1.13 | 0.90 | 2.10 |
| 8 | 1.43 | 1.14 | 3.22 |
| 16 | 1.97 | 1.92 | 5.32 |
| 32 | 3.00 | 3.38 | 9.56 |

TARGET_ROWS takes them with T(1) = 1 and T(5) = 1.12 (the single sequence's figures above: 4 verification rows, 0.03
each); DRAFT_ROWS scales R to R(1) = 0.65, the single draft row above (after another model's call the plain step
costs more, and R(1) came out lower).

By them a caught-up sequence alone keeping 90% of its drafts stops paying past ~1,200 tokens of context (97%: ~1,700);
before it has drafted, 128 tokens to make pay for the catch-up of a prompt of up to ~240 tokens (sampled: ~190); a
1,559-token prompt never drafts. Checked end to end on the same machine (bench/engine_speculative_pays.py `--scenarios
len150,len250,len400,len700 --kinds always,plain`: one request, 128 greedy tokens, 97-100% of drafts kept, the decoder
drafting whenever it can against none; two runs): 1.05-1.06x at a 150-token prompt, 0.99-1.04x at 250, 0.96x at 400,
0.80-0.81x at 700, where these costs put the break-even at 325 tokens for all drafts kept. With `--max-batch 16
--scenarios streams1,streams4,streams16 --kinds costed,plain` (ShareGPT prompts, greedy, up to 128 tokens), against
the model of a sequence alone (in parentheses, the commit before, same session): 16 streams 0.97-1.02x of plain
(0.63x), 4 streams 0.99-1.00x (0.92x), 1 stream 1.14-1.20x (1.20x); 3 rounds a run, three runs, 2026-12-04.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

PRIOR_KEPT = 0.9  # the share of drafted tokens a sequence is taken to keep before it has drafted
PRIOR_DRAFTS = 8  # ... weighing as much as this many of its own drafted tokens
# (rows, cost in D0) at a short context (module docstring), rows of one step: the target's (a plain step of B
# sequences: B rows; a speculative step's verification: 1 + k a sequence); the draft's round (one row a sequence)
TARGET_ROWS = ((1, 1.0), (2, 1.02), (5, 1.12), (8, 1.43), (10, 1.48), (16, 1.97), (20, 2.1), (32, 3.0), (40, 3.22),
               (80, 5.32), (160, 9.56))
DRAFT_ROWS = ((1, 0.65), (2, 0.74), (4, 0.94), (8, 1.19), (16, 2.01), (32, 3.54))

Rows = tuple[tuple[int, float], ...]


def interpolate(table: Rows, n: float) -> float:
    """table's cost of n rows: linear between its points, and past its last at its last segment's slope."""
    i = min(max(bisect_left(table, n, key=lambda point: point[0]), 1), len(table) - 1)
    (n0, c0), (n1, c1) = table[i - 1], table[i]
    return c0 + (c1 - c0) * (n - n0) / (n1 - n0)


def kept_share(drafted: int, kept: int) -> float:
    """The share of its drafted tokens a sequence is expected to keep: its own, after the prior's."""
    return (kept + PRIOR_KEPT * PRIOR_DRAFTS) / (drafted + PRIOR_DRAFTS)


@dataclass(frozen=True)
class DraftCosts:
    """Costs in D0, a plain decode step of one sequence of the target at a short context (see the module docstring).
    The catch-up's shares are engine/speculative.py's: `catch_up_rows` rows read at a start a step, a row read after c
    others costing 1 + c / `catch_up_context` of those."""

    catch_up_rows: int
    catch_up_context: float
    target_rows: Rows = TARGET_ROWS  # T: the target's step of n single-token rows at a short context
    draft_rows: Rows = DRAFT_ROWS  # R: a draft round of n rows
    decode_context: float = 4600.0  # a sequence's row at context c costs c / decode_context more ...
    verify_row_context: float = 12200.0  # ... and each of its verification rows c / verify_row_context more
    draft_row_context: float = 2200.0  # a draft row at context c: 1 + c / draft_row_context times R(1) more
    catch_up_row: float = 0.063  # a catch-up row read at a sequence's start
    sampled_row: float = 0.025  # one more sampled distribution (a draft's or a verification row's)

    def step(self, seqs: list[tuple[float, int, bool]]) -> float:
        """A step of these sequences, each (context, tokens it drafts, sampled), their catch-up aside; a plain step
        when none drafts."""
        rounds = [sum(k >= j for _, k, _ in seqs) for j in range(1, max(k for _, k, _ in seqs) + 1)]
        return self._rows(sum(1 + k for _, k, _ in seqs), rounds) + sum(self._own(*seq) for seq in seqs)

    def _rows(self, target_rows: int, draft_rounds: list[int]) -> float:
        """The target's rows and the draft's rounds (rows each) of a step, at a short context."""
        return interpolate(self.target_rows, target_rows) + sum(interpolate(self.draft_rows, m) for m in draft_rounds)

    def _own(self, context: float, k: int, sampled: bool) -> float:
        """What a sequence's context and sampling add to a step: its row and its verification and draft rows at
        `context`, its 2k more distributions."""
        cost = context / self.decode_context + k * context / self.verify_row_context
        cost += k * interpolate(self.draft_rows, 1) * context / self.draft_row_context
        return cost + (2 * k * self.sampled_row if sampled else 0.0)

    def per_token(self, seqs: list[tuple[float, int, float, bool]]) -> float:
        """A step's expected cost per token it makes, its sequences each (context, tokens it drafts, its kept share,
        sampled)."""
        return self.step([(c, k, sampled) for c, k, _, sampled in seqs]) / sum(1 + k * f for _, k, f, _ in seqs)

    def catch_up(self, read: int, rows: int) -> float:
        """The draft reading `rows` tokens after the `read` it has, in start-of-prompt rows."""
        return rows + (rows * read + rows * (rows - 1) / 2) / self.catch_up_context

    def pays(self, *, k: int, context: int, read: int, left: int, drafted: int, kept: int, sampled: bool,
             batch: int = 1) -> bool:
        """Whether a sequence of `context` tokens, `read` of them in the draft's cache, with `left` tokens it may still
        make, should draft k tokens a step (or go on catching up) in steps of `batch` sequences: its expected saving
        exceeds the catch-up's cost."""
        if k < 1 or left < 2:
            return False
        made = 1 + k * kept_share(drafted, kept)

        def saving(c: float) -> float:  # per token made at context c (linear in c): shares of steps of `batch` alike
            plain = self._rows(batch, []) / batch + self._own(c, 0, False)
            return plain - (self._rows(batch * (1 + k), [batch] * k) / batch + self._own(c, k, sampled)) / made

        first, last = saving(context), saving(context + left)
        if first <= 0:
            return False
        # past the context where a step no longer pays (last < 0), the sequence stops drafting: only the tokens before
        total = left * (first + last) / 2 if last >= 0 else left * first / (first - last) * first / 2
        rows = self.catch_up(read, max(context - 1 - read, 0))
        plain_steps = int(rows // self.catch_up_rows) if rows > self.catch_up_rows else 0  # decoding, catching up
        return total - plain_steps * first > rows * self.catch_up_row
