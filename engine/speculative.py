"""Speculative decoding: a cheap draft model proposes k tokens, the engine's model checks them in one step.

A decode step of a small model on a CPU costs about as much for a few rows as for one (the weights are read
once either way), so the target model can score k drafted tokens and the token after them in one step of k + 1
rows (ModelRunner.logits_of_rows: each row attends to the positions before it). The standard acceptance rule
(Leviathan et al. 2023; Chen et al. 2023) keeps the target's output distribution exactly: draft token d, drawn
from the draft's distribution q, is kept with probability min(1, p(d) / q(d)) under the target's p; the first one
refused is replaced by a draw from max(0, p - q), normalised; when all k are kept, one more token is drawn from
p. Greedy requests keep a draft token when it is the target's argmax, so their output is plain greedy decoding's.
Both distributions go through the request's own temperature, top-k and top-p (engine/sampler.py), and a seeded
request draws every random number from its own generator.

What it runs on: a step the scheduler made of decodes only (one new token per sequence), at most `max_batch`
sequences, none with a response format, logprobs or a presence or frequency penalty (those take the plain step: a
step with one of them is plain for all). Above `max_batch` the k + 1 rows per sequence cost more than the draft
saves (BENCHMARKS.md, "Speculative decoding"). The draft keeps its own paged KV cache and block manager; each
sequence's draft state is the number of its tokens whose draft K/V are valid, which only ever grows along the
sequence's tokens, so a preempted sequence keeps it. Rejected rows leave K/V past the accepted tokens in both caches;
those slots are written again before anything reads them.

Catching up. Before it drafts, the draft reads every token of the sequence it has not read yet: a whole prompt the
first time. A step's catch-up rows cost at most CATCH_UP_ROWS rows read at a sequence's start (a row read after c
others costs 1 + c / CATCH_UP_CONTEXT of those): a sequence further behind than that reads its share and takes a
plain step (`run` returns None; with several sequences, it decodes its next token in the others' speculative step),
until the rest fits in one step and it drafts. A greedy request's tokens are plain decoding's either way; a sampled
one's follow the target's distribution, though a seeded one with a long prompt draws its numbers in another order
than when the whole catch-up ran in its first decode step. Measured in one `full` engine on one core, a 1,559-token
prompt answered in 128 tokens: its catch-up took one step of 2.3-2.6 s, and another tenant's short request arriving
as it began waited 2.4-2.8 s (0.10 s alone); in shares, 37 steps of 0.08-0.09 s and 0.23-0.24 s, for the prompt's
request 6.8-7.2 s instead of 6.4-6.9 s.

Whether it pays. Against 4.4 s without speculation, that request lost either way: the catch-up costs more than a
128-token answer saves, and at that context a speculative step costs more than the tokens it makes. A sequence
drafts (and catches up) only while engine/draft_cost.py's cost model, measured on the same core, says its expected
saving (the tokens it may still make, at its own share of drafts kept) exceeds the draft's reading of its unread
tokens; otherwise it decodes plainly and the draft reads none of it. A step in which no sequence drafts is a plain
step, so a greedy answer is plain decoding's and a seeded one draws as plain decoding does.

The batch counts too: a plain step of 16 sequences costs about twice one of a single sequence, so a kept draft token
saves far less there, while the verification and draft rows cost about a row's compute each. Each sequence judges at
the step's number of sequences, and a step drafts only if, for the sequences that would draft in it, the cost model
expects it to cost less a token than a plain step of them (engine/draft_cost.py). Before, each judged as if it ran
alone: 16 streams with `max_batch` 16 ran at 0.62x of plain; now their steps are plain until few are left. A seeded
sampled request judges as if in a step of `max_batch` sequences, the most a speculative step holds, whatever the step:
the order its numbers are drawn in depends on how it drafts, and its answer must not depend on the requests beside it
(at `max_batch` 1, the `full` tier's, it judges as if alone; at 16 it never drafts, rather than lose in a batch).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.draft_cost import DraftCosts, kept_share
from engine.sampler import Sampler, uniform
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger("tiergate.engine.speculative")
MAX_K = 8
MAX_ROWS = 512  # rows per draft call (a step's first call holds its catch-up rows and each sequence's last token)
# A step's catch-up rows cost at most this many rows read at a sequence's start. Measured on one core, the int8 draft
# (mid) reads n rows of one sequence after c others (logits_of_rows) in 0.78-0.92 ms a row at c = 0 (n = 32-512),
# 1.3-1.5 at 512, 1.9-2.2 at 1,024, 2.5-2.8 at 1,536, 3.7-4.4 at 2,300 (beside a plain decode of `full`, 15-22 ms):
# 96 of them, ~0.08 s, keep a catch-up step as short as a step the scheduler shares between tenants. In one A/B of a
# 1,559-token prompt (module docstring), a newcomer's latency and the prompt's request time: at 48, 0.22-0.23 s and
# 8.0-8.5 s; at 96, 0.26 s and 7.5-7.8 s; at 192, 0.32 s and 7.4-7.8 s; the whole catch-up in one step, 2.6-2.9 s and
# 7.0-7.4 s (a loaded machine: slower than the docstring's numbers)
CATCH_UP_ROWS = 96
CATCH_UP_CONTEXT = 640  # a draft row read after this many others costs about twice one at a sequence's start
# A step catches up at least this many rows (past ~3,200 tokens of context, beyond the default draft cache): fewer a
# call cost more each, 1.3-1.6x a row of 128-row calls at 16 rows, 1.5-2.1x at 8 (same measurement)
MIN_CATCH_UP_ROWS = 16
# whether drafting pays for a sequence, measured on the same core (engine/draft_cost.py)
DEFAULT_COSTS = DraftCosts(catch_up_rows=CATCH_UP_ROWS, catch_up_context=CATCH_UP_CONTEXT)


@dataclass(frozen=True)
class SpeculativeConfig:
    k: int = 4  # tokens the draft proposes per step
    max_batch: int = 4  # speculate only while at most this many sequences decode
    costs: DraftCosts | None = DEFAULT_COSTS  # a sequence drafts only while these say it pays (None: whenever it can)

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"speculative k must be within 1..{MAX_K} (got {self.k})")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be at least 1 (got {self.max_batch})")


@dataclass
class _Plan:
    """One sequence's part of a speculative step."""

    seq: Sequence
    k: int  # tokens to draft (0: this sequence only decodes its next token)
    drafts: list[int]
    draft_probs: list[torch.Tensor | None]  # per draft token: the draft's distribution (None: greedy)
    left: int = 0  # the tokens the sequence may still make
    catch_up: int = 0  # a sequence still catching up (k = 0): the tokens the draft reads for it this step
    error: str | None = None  # why its sampling raised this step (it then makes no token and is left out of the rest)
    cut: int = 0  # of its k, the tokens the draft did not propose: its logits held NaN (the draft ended there)


def _seeded(plan: _Plan) -> bool:
    """A seeded sampled request: it judges whether drafting pays as if in a step of max_batch sequences, so that its
    numbers are drawn in the same order whatever runs beside it (how it drafts decides the order)."""
    return plan.seq.params.temperature > 0.0 and plan.seq.params.seed is not None


def eligible(params: SamplingParams) -> bool:
    """Requests whose tokens the acceptance rule can check: no grammar mask, no log-probabilities to report, and no
    presence or frequency penalty (each position's would count the drafts before it: such a request takes the plain
    step, whose sampler applies them)."""
    return params.grammar is None and params.logprobs is None and not params.penalized


class SpeculativeDecoder:
    def __init__(self, target: ModelRunner, draft: ModelRunner, config: SpeculativeConfig) -> None:
        """`target` and `draft` are ModelRunners over the same vocabulary (the draft's tokenizer must be the
        target's: the launcher checks it)."""
        t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
        if t_vocab != d_vocab:
            raise ValueError(f"the draft model's vocabulary ({d_vocab}) is not the target's ({t_vocab})")
        self.target = target
        self.draft = draft
        self.config = config
        self.sampler = target.sampler  # the requests' own generators
        self.blocks = BlockManager(draft.num_kv_blocks, draft.block_size, enable_prefix_caching=False)
        self._states: dict[str, Sequence] = {}  # request id -> its draft state (block table, valid tokens)
        self._tallies: dict[str, tuple[int, int]] = {}  # request id -> its tokens drafted, kept
        self.num_steps = 0
        self.num_draft_tokens = 0  # proposed
        self.num_accepted_tokens = 0  # of those, kept
        # request id -> why its sampling raised in the last `run` (it made no token): the engine fails it alone, as the
        # model runner's `last_errors` after a plain step
        self.last_errors: dict[str, str] = {}

    def applies(self, out: SchedulerOutput) -> bool:
        return (0 < len(out.seqs) <= self.config.max_batch and all(n == 1 for n in out.num_scheduled_tokens)
                and all(out.do_sample) and all(eligible(s.params) for s in out.seqs))

    def release(self, request_id: str) -> None:
        self._tallies.pop(request_id, None)
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, target_blocks: BlockManager, max_model_len: int) -> list[list[int]] | None:
        """The tokens each sequence of `out` makes this step (1 to k + 1 each, in order), or None when the caller is
        to run a plain step: the target's KV cache has no room for the verification rows, or no sequence drafts
        (drafting does not pay for any, or those that would are still catching up: the draft has read its share of
        their tokens). A sequence whose sampling raises (drawing a draft token, or the target's), or whose target
        logits hold NaN where it draws, makes no token and is named in `last_errors`; the others of the step go on.
        (NaN in the draft's logits only ends that sequence's draft: `_propose`.)"""
        self.last_errors = {}
        plans = []
        for seq in out.seqs:
            left = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
            plans.append(_Plan(seq, max(min(self.config.k, left - 1), 0), [], [], left))
        self._share_catch_up(plans)
        self._judge_step(plans)
        if not any(p.k for p in plans):
            if any(p.catch_up for p in plans):
                self._draft(plans)  # the catch-up rows alone, beside the caller's plain step
            return None
        for plan in plans:  # rows T-1 .. T-1+k: blocks up to position T-1+k
            if not target_blocks.allocate_slots(plan.seq, plan.k + 1):
                return None
        self._draft(plans)
        emitted = self._verify(plans)
        self.num_steps += 1
        return emitted

    # ---- the draft ----

    def _share_catch_up(self, plans: list[_Plan]) -> None:
        """Which plans draft this step: those for which drafting pays, with draft room, whose unread tokens (but the
        last) fit in what is left of the step's catch-up cost, least behind first; the next one further behind reads
        what is left (at least MIN_CATCH_UP_ROWS), the others wait. A plan that does not draft gets k = 0."""
        behind = []
        for p in plans:
            if p.k and self._pays(p, self.config.max_batch if _seeded(p) else len(plans)) and self._room(p):
                state = self._states[p.seq.request_id]
                behind.append((p.seq.num_tokens - 1 - state.num_computed_tokens, p, state))
            else:
                p.k = 0  # no draft room (or none wanted): this sequence only decodes its next token
        budget, catching_up = float(CATCH_UP_ROWS), False
        for n, p, state in sorted(behind, key=lambda b: b[0]):
            rows = 0
            while rows < n and budget >= (cost := 1 + (state.num_computed_tokens + rows) / CATCH_UP_CONTEXT):
                budget -= cost
                rows += 1
            if rows == n:
                continue
            p.k = 0
            if not catching_up:  # the draft's blocks for these rows were allocated by _room
                p.catch_up, catching_up, budget = max(rows, min(n, MIN_CATCH_UP_ROWS)), True, 0.0

    def _draft(self, plans: list[_Plan]) -> None:
        """Propose each plan's k tokens: catch the draft's cache up with the sequence, then one row per round."""
        active = [p for p in plans if p.k]
        # round 1: every token the draft has not seen, the last one's logits giving the first draft token; and the
        # catch-up rows of a plan that does not draft yet
        rows: list[tuple[int, int, list[int]]] = []  # (token, position, block table)
        last_row: dict[int, int] = {}  # plan index in `active` -> its last row
        for i, p in enumerate(active):
            state, tokens = self._states[p.seq.request_id], p.seq.token_ids
            for pos in range(state.num_computed_tokens, len(tokens)):
                rows.append((tokens[pos], pos, state.block_table))
            last_row[i] = len(rows) - 1
        for p in plans:
            if p.catch_up:
                state, tokens = self._states[p.seq.request_id], p.seq.token_ids
                start = state.num_computed_tokens
                rows += [(tokens[pos], pos, state.block_table) for pos in range(start, start + p.catch_up)]
                state.num_computed_tokens += p.catch_up
        if not rows:
            return
        logits = self._draft_rows(rows, [last_row[i] for i in range(len(active))])
        if not active:
            return
        self._propose(active, logits)
        for j in range(1, max(p.k for p in active)):  # rounds 2..k: the previous draft token, one row each
            going = [p for p in active if p.k > j and p.error is None]
            if not going:  # the drafts still going this round all ended (NaN)
                break
            rows = [(p.drafts[-1], p.seq.num_tokens + j - 1, self._states[p.seq.request_id].block_table)
                    for p in going]
            self._propose(going, self._draft_rows(rows, list(range(len(rows)))))

    def _pays(self, plan: _Plan, batch: int) -> bool:
        """Whether drafting (or catching up to draft) pays for the plan's sequence in a step of `batch` sequences
        (engine/draft_cost.py)."""
        costs, seq = self.config.costs, plan.seq
        if costs is None:
            return True
        state = self._states.get(seq.request_id)
        drafted, kept = self._tallies.get(seq.request_id, (0, 0))
        return costs.pays(k=plan.k, context=seq.num_tokens, read=state.num_computed_tokens if state else 0,
                          left=plan.left, drafted=drafted, kept=kept, sampled=seq.params.temperature > 0.0,
                          batch=batch)

    def _judge_step(self, plans: list[_Plan]) -> None:
        """The plans that would draft this step draft only if the cost model expects the step to cost less a token
        than with them decoding plainly (engine/draft_cost.py); otherwise they take k = 0. A seeded sampled request's
        stays (it judged at max_batch)."""
        costs = self.config.costs
        if costs is None or not any(p.k and not _seeded(p) for p in plans):
            return
        seqs = [(p.seq.num_tokens, p.k, kept_share(*self._tallies.get(p.seq.request_id, (0, 0))),
                 p.seq.params.temperature > 0.0) for p in plans]
        without = [(c, k if _seeded(p) else 0, f, sampled) for (c, k, f, sampled), p in zip(seqs, plans, strict=True)]
        if costs.per_token(seqs) >= costs.per_token(without):
            for p in plans:
                p.k = p.k if _seeded(p) else 0

    def _room(self, plan: _Plan) -> bool:
        """Draft blocks for the plan's rows (positions up to T + k - 2); False when the draft's cache is full. (The
        blocks of a sequence still catching up are allocated whole, as if it drafted: it will.)"""
        seq = plan.seq
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = Sequence(seq.request_id, [], seq.params)
        return self.blocks.allocate_slots(state, seq.num_tokens + plan.k - 1 - state.num_computed_tokens)

    def _draft_rows(self, rows: list[tuple[int, int, list[int]]], wanted: list[int]) -> torch.Tensor:
        """The draft's logits of the `wanted` rows (none: only their K/V), the rows run in calls of at most MAX_ROWS."""
        out = []
        for start in range(0, len(rows), MAX_ROWS):
            chunk = rows[start:start + MAX_ROWS]
            want = [w - start for w in wanted if start <= w < start + len(chunk)]
            tokens, positions, tables = zip(*chunk, strict=True)
            out.append(self.draft.logits_of_rows(list(tokens), list(positions), list(tables), want))
        return torch.cat(out)

    def _propose(self, plans: list[_Plan], logits: torch.Tensor) -> None:
        """Each plan's next draft token from its row. A row holding NaN (a numeric fault in the draft), or one whose
        distribution is not finite (+inf: inf - inf is NaN in the rule's shift), or whose sampling raises, proposes
        nothing: the plan's draft ends before it, and the target checks the tokens drafted so far and draws the next
        itself (whose own sampling fails the sequence if the fault is the request's, as in a plain step). The acceptance
        rule keeps the target's distribution for any draft, of any length, that the target's draws do not decide, so the
        sequence's tokens stay distributed exactly as the target's (failing it instead would fail a request the target
        can serve)."""
        nan_rows = _nan_rows(logits)
        for p, row, nan in zip(plans, logits, nan_rows, strict=True):
            params = p.seq.params
            if nan:
                p.k, p.cut = len(p.drafts), p.k - len(p.drafts)
                continue
            try:
                if params.temperature == 0.0:
                    p.drafts.append(int(torch.argmax(row)))
                    p.draft_probs.append(None)
                else:
                    q = Sampler.distribution(row, params)
                    if not math.isfinite(float(q.sum())):  # +inf in the row: the rule's shift made it NaN (inf - inf)
                        raise FloatingPointError("the draft's distribution is not finite")
                    p.drafts.append(Sampler.draw(q, self.sampler.generator(p.seq.request_id, params)))
                    p.draft_probs.append(q)
            except Exception as exc:  # the draft's fault (a row its sampling cannot read: +inf), as NaN's above
                log.debug("speculative: %s's draft ends at a row its sampling refused: %r", p.seq.request_id, exc)
                p.k, p.cut = len(p.drafts), p.k - len(p.drafts)

    def _failed(self, p: _Plan, exc: Exception) -> None:
        p.error = self.last_errors[p.seq.request_id] = f"{type(exc).__name__}: {exc}"

    # ---- the target ----

    def _verify(self, every: list[_Plan]) -> list[list[int]]:
        """Score [last token, d1..dk] of every plan in one target step; apply the acceptance rule. A plan whose
        sampling failed makes no token."""
        plans = [p for p in every if p.error is None]
        tokens, positions, tables = [], [], []
        for p in plans:
            start = p.seq.num_tokens - 1
            tokens += [p.seq.last_token_id, *p.drafts]
            positions += range(start, start + p.k + 1)
            tables += [p.seq.block_table] * (p.k + 1)
        if not plans:
            return [[] for _ in every]
        logits = self.target.logits_of_rows(tokens, positions, tables, list(range(len(tokens))))
        made_by: dict[int, list[int]] = {}  # id(plan) -> the tokens it makes
        row = 0
        for p in plans:
            rows, row = logits[row:row + p.k + 1], row + p.k + 1
            try:
                made = self._accept(p, rows)
            except Exception as exc:  # this sequence's own sampling: the others keep their tokens
                self._failed(p, exc)
                continue
            accepted = len(made) - 1
            self.num_draft_tokens += p.k
            self.num_accepted_tokens += accepted
            if p.k or p.cut:  # tokens the draft could not propose count as refused: a draft that keeps failing stops
                # paying for the sequence (engine/draft_cost.py)
                drafted, kept = self._tallies.get(p.seq.request_id, (0, 0))
                self._tallies[p.seq.request_id] = (drafted + p.k + p.cut, kept + accepted)
                # the draft's K/V are valid up to its last kept token that it has computed: it read each draft token
                # but the last, and the last too when its draft ended on a NaN row (that round read it)
                computed = p.k if p.cut else p.k - 1
                self._states[p.seq.request_id].num_computed_tokens = p.seq.num_tokens + min(accepted, computed)
            made_by[id(p)] = made
        return [made_by.get(id(p), []) for p in every]

    def _accept(self, p: _Plan, logits: torch.Tensor) -> list[int]:
        """The tokens the plan makes: its kept draft tokens, then the target's own (a replacement or one more).

        A row of the target's logits holding NaN has no next token (argmax and the draw would each pick an arbitrary
        index from it): reaching one raises FloatingPointError, and the sequence fails alone, as in a plain step
        (engine/model_runner.py). A row after a refused draft token is never reached, as a plain step never computes
        it."""
        params, rid = p.seq.params, p.seq.request_id
        nan_rows = _nan_rows(logits)

        def row(i: int) -> torch.Tensor:
            if nan_rows[i]:
                raise FloatingPointError("the model's logits for this sequence hold NaN")
            return logits[i]

        if params.temperature == 0.0:
            target = logits.argmax(dim=-1).tolist()
            made = []
            for i in range(p.k + 1):
                row(i)
                if i == p.k or p.drafts[i] != target[i]:
                    return [*made, target[i]]
                made.append(p.drafts[i])
        gen = self.sampler.generator(rid, params)
        made = []
        for i, d in enumerate(p.drafts):
            probs, q = Sampler.distribution(row(i), params), p.draft_probs[i]
            assert q is not None
            if uniform(gen) * float(q[d]) <= float(probs[d]):
                made.append(d)
                continue
            residual = (probs - q).clamp_min(0.0)
            total = float(residual.sum())
            pick = residual / total if total > 0 else probs
            return [*made, Sampler.draw(pick, gen)]
        probs = Sampler.distribution(row(p.k), params)
        return [*made, Sampler.draw(probs, gen)]


def _nan_rows(logits: torch.Tensor) -> list[bool]:
    """Which rows of `logits` [R, V] hold NaN: a row's sum is NaN exactly when it holds one (or holds both +inf and
    -inf, no row of logits either). A tenth of `isnan().any()`'s time (5 against 57 us a row of SmolLM2's 49,152 on
    one core), which on every row of every speculative step would have cost a few per cent of it."""
    return logits.sum(dim=-1).isnan().tolist()
