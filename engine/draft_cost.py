"""Whether drafting pays for one sequence: the draft's catch-up and its speculative steps against the plain steps they
would save, in plain decode steps of the target at a short context (D0).

A speculative step of a sequence drafting k tokens at context c costs the target's decode step D(c), k more
verification rows and k single draft rows (and, for a sampled request, 2k more distributions), and makes on average
E = 1 + k f tokens, f being the share of its drafted tokens kept; E plain steps would have cost E D(c). So each token
saves D(c) - step / E, which falls as the context grows, and the tokens a sequence may still make (max_tokens left, or
the context left) save its sum over them, up to the context where it reaches 0 (there the sequence stops drafting).
Against it: the draft's catch-up, every token it has not read yet, a row read after c others costing catch_up_row
(1 + c / catch_up_context), and the tokens decoded plainly while the catch-up is spread over steps
(engine/speculative.py: CATCH_UP_ROWS start-of-prompt rows a step). A sequence drafts only while the saving exceeds
that cost, so a long prompt whose catch-up outweighs a short answer never drafts, and at a context where a speculative
step costs more than the tokens it makes, no sequence drafts even when caught up.

f is the sequence's own: its kept and drafted tokens so far, after PRIOR_DRAFTS tokens kept at PRIOR_KEPT (the int8
draft of `mid` kept 86-98% for `full` at one stream, BENCHMARKS.md). The decision depends only on the sequence (its
tokens, max_tokens, the draft's progress on it and its own acceptance), so a seeded request draws its numbers in the
same order each time it runs alone.

The constants were measured on one core of an AMD EPYC (AVX-512 BF16, no AMX) with the `full` tier's target
(SmolLM2-135M, bf16) and draft (the same model int8), `.venv/bin/python -m bench.draft_costs` (median of 5; a second
run on a busier machine was 10-35% slower, each cost's ratio to D within 0.2 of this one's), D0 = 12.3 ms:

| context | plain decode D | 5 verification rows | one draft row | a catch-up row (128 a call) |
|---|---|---|---|---|
| 64 | 12.3 ms | 14.0 ms | 8.2 ms | 0.78 ms |
| 512 | 13.2 ms | 17.0 ms | 9.9 ms | 1.27 ms |
| 1,024 | 15.1 ms | 21.0 ms | 12.5 ms | 1.87 ms |
| 1,550 | 16.5 ms | 24.2 ms | 13.7 ms | 2.42 ms |

and a sampled distribution (T=0.8, top_p=0.95; engine/sampler.py) 0.2-0.4 ms. By them a caught-up sequence keeping
90% of its drafts stops paying past ~1,200 tokens of context (97%: ~1,700); before it has drafted, 128 tokens to make
pay for the catch-up of a prompt of up to ~240 tokens (sampled: ~190); a 1,559-token prompt never drafts. Checked end
to end on the same machine (bench/engine_speculative_pays.py `--scenarios len150,len250,len400,len700 --kinds
always,plain`: one request, 128 greedy tokens, 97-100% of drafts kept, the decoder drafting whenever it can against
none; two runs): 1.05-1.06x at a 150-token prompt, 0.99-1.04x at 250, 0.96x at 400, 0.80-0.81x at 700, where these
costs put the break-even at 325 tokens for all drafts kept.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_KEPT = 0.9  # the share of drafted tokens a sequence is taken to keep before it has drafted
PRIOR_DRAFTS = 8  # ... weighing as much as this many of its own drafted tokens


@dataclass(frozen=True)
class DraftCosts:
    """Costs in D0, a plain decode step of the target at a short context (see the module docstring). The catch-up's
    shares are engine/speculative.py's: `catch_up_rows` rows read at a start a step, a row read after c others costing
    1 + c / `catch_up_context` of those."""

    catch_up_rows: int
    catch_up_context: float
    decode_context: float = 4600.0  # D(c) = 1 + c / decode_context
    verify_row: float = 0.03  # one more verification row at a short context ...
    verify_row_context: float = 12200.0  # ... plus c / verify_row_context
    draft_row: float = 0.65  # one single-row draft round at a short context, times 1 + c / draft_row_context
    draft_row_context: float = 2200.0
    catch_up_row: float = 0.063  # a catch-up row read at a sequence's start
    sampled_row: float = 0.025  # one more sampled distribution (a draft's or a verification row's)

    def decode(self, context: float) -> float:
        return 1 + context / self.decode_context

    def step(self, k: int, context: float, sampled: bool) -> float:
        """A speculative step drafting k tokens for one sequence at `context`, its catch-up aside."""
        verify = k * (self.verify_row + context / self.verify_row_context)
        draft = k * self.draft_row * (1 + context / self.draft_row_context)
        return self.decode(context) + verify + draft + (2 * k * self.sampled_row if sampled else 0.0)

    def catch_up(self, read: int, rows: int) -> float:
        """The draft reading `rows` tokens after the `read` it has, in start-of-prompt rows."""
        return rows + (rows * read + rows * (rows - 1) / 2) / self.catch_up_context

    def pays(self, *, k: int, context: int, read: int, left: int, drafted: int, kept: int, sampled: bool) -> bool:
        """Whether a sequence of `context` tokens, `read` of them in the draft's cache, with `left` tokens it may still
        make, should draft k tokens a step (or go on catching up): its expected saving exceeds the catch-up's cost."""
        if k < 1 or left < 2:
            return False
        kept_share = (kept + PRIOR_KEPT * PRIOR_DRAFTS) / (drafted + PRIOR_DRAFTS)

        def saving(c: float) -> float:  # per token made at context c (linear in c)
            return self.decode(c) - self.step(k, c, sampled) / (1 + k * kept_share)

        first, last = saving(context), saving(context + left)
        if first <= 0:
            return False
        # past the context where a step no longer pays (last < 0), the sequence stops drafting: only the tokens before
        total = left * (first + last) / 2 if last >= 0 else left * first / (first - last) * first / 2
        rows = self.catch_up(read, max(context - 1 - read, 0))
        plain_steps = int(rows // self.catch_up_rows) if rows > self.catch_up_rows else 0  # decoding, catching up
        return total - plain_steps * first > rows * self.catch_up_row
