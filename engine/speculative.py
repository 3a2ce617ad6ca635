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
sequences, none with a response format or logprobs (those take the plain step). Above `max_batch` the k + 1
rows per sequence cost more than the draft saves (BENCHMARKS.md, "Speculative decoding"). The draft keeps its
own paged KV cache and block manager; each sequence's draft state is the number of its tokens whose draft K/V
are valid, which only ever grows along the sequence's tokens, so a preempted sequence keeps it. Rejected rows
leave K/V past the accepted tokens in both caches; those slots are written again before anything reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

MAX_K = 8
MAX_ROWS = 512  # rows per draft call while it catches up with a long prompt


@dataclass(frozen=True)
class SpeculativeConfig:
    k: int = 4  # tokens the draft proposes per step
    max_batch: int = 4  # speculate only while at most this many sequences decode

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


def eligible(params: SamplingParams) -> bool:
    """Requests whose tokens the acceptance rule can check: no grammar mask, no log-probabilities to report."""
    return params.grammar is None and params.logprobs is None


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
        self.num_steps = 0
        self.num_draft_tokens = 0  # proposed
        self.num_accepted_tokens = 0  # of those, kept

    def applies(self, out: SchedulerOutput) -> bool:
        return (0 < len(out.seqs) <= self.config.max_batch and all(n == 1 for n in out.num_scheduled_tokens)
                and all(out.do_sample) and all(eligible(s.params) for s in out.seqs))

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, target_blocks: BlockManager, max_model_len: int) -> list[list[int]] | None:
        """The tokens each sequence of `out` makes this step (1 to k + 1 each, in order), or None when the target's
        KV cache has no room for the verification rows (the caller then runs a plain step)."""
        plans = []
        for seq in out.seqs:
            room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
            k = min(self.config.k, room)
            plans.append(_Plan(seq, max(k, 0), [], []))
        for plan in plans:  # rows T-1 .. T-1+k: blocks up to position T-1+k
            if not target_blocks.allocate_slots(plan.seq, plan.k + 1):
                return None
        self._draft(plans)
        emitted = self._verify(plans)
        self.num_steps += 1
        return emitted

    # ---- the draft ----

    def _draft(self, plans: list[_Plan]) -> None:
        """Propose each plan's k tokens: catch the draft's cache up with the sequence, then one row per round."""
        active = []
        for p in plans:
            if p.k and self._room(p):
                active.append(p)
            else:
                p.k = 0  # no draft room (or none wanted): this sequence only decodes its next token
        if not active:
            return
        # round 1: every token the draft has not seen, the last one's logits giving the first draft token
        rows: list[tuple[int, int, list[int]]] = []  # (token, position, block table)
        last_row: dict[int, int] = {}  # plan index in `active` -> its last row
        for i, p in enumerate(active):
            state, tokens = self._states[p.seq.request_id], p.seq.token_ids
            for pos in range(state.num_computed_tokens, len(tokens)):
                rows.append((tokens[pos], pos, state.block_table))
            last_row[i] = len(rows) - 1
        logits = self._draft_rows(rows, [last_row[i] for i in range(len(active))])
        self._propose(active, logits)
        for j in range(1, max(p.k for p in active)):  # rounds 2..k: the previous draft token, one row each
            going = [p for p in active if p.k > j]
            rows = [(p.drafts[-1], p.seq.num_tokens + j - 1, self._states[p.seq.request_id].block_table)
                    for p in going]
            self._propose(going, self._draft_rows(rows, list(range(len(rows)))))

    def _room(self, plan: _Plan) -> bool:
        """Draft blocks for the plan's rows (positions up to T + k - 2); False when the draft's cache is full."""
        seq = plan.seq
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = Sequence(seq.request_id, [], seq.params)
        return self.blocks.allocate_slots(state, seq.num_tokens + plan.k - 1 - state.num_computed_tokens)

    def _draft_rows(self, rows: list[tuple[int, int, list[int]]], wanted: list[int]) -> torch.Tensor:
        """The draft's logits of the `wanted` rows, the rows run in calls of at most MAX_ROWS."""
        out = []
        for start in range(0, len(rows), MAX_ROWS):
            chunk = rows[start:start + MAX_ROWS]
            want = [w - start for w in wanted if start <= w < start + len(chunk)]
            tokens, positions, tables = zip(*chunk, strict=True)
            out.append(self.draft.logits_of_rows(list(tokens), list(positions), list(tables), want))
        return torch.cat(out)

    def _propose(self, plans: list[_Plan], logits: torch.Tensor) -> None:
        for p, row in zip(plans, logits, strict=True):
            params = p.seq.params
            if params.temperature == 0.0:
                p.drafts.append(int(torch.argmax(row)))
                p.draft_probs.append(None)
            else:
                q = Sampler.distribution(row, params)
                p.drafts.append(Sampler.draw(q, self.sampler.generator(p.seq.request_id, params)))
                p.draft_probs.append(q)

    # ---- the target ----

    def _verify(self, plans: list[_Plan]) -> list[list[int]]:
        """Score [last token, d1..dk] of every plan in one target step; apply the acceptance rule."""
        tokens, positions, tables = [], [], []
        for p in plans:
            start = p.seq.num_tokens - 1
            tokens += [p.seq.last_token_id, *p.drafts]
            positions += range(start, start + p.k + 1)
            tables += [p.seq.block_table] * (p.k + 1)
        logits = self.target.logits_of_rows(tokens, positions, tables, list(range(len(tokens))))
        emitted, row = [], 0
        for p in plans:
            made = self._accept(p, logits[row:row + p.k + 1])
            row += p.k + 1
            accepted = len(made) - 1
            self.num_draft_tokens += p.k
            self.num_accepted_tokens += accepted
            if p.k:  # the draft's K/V are valid up to its last kept token that it has computed
                self._states[p.seq.request_id].num_computed_tokens = p.seq.num_tokens + min(accepted, p.k - 1)
            emitted.append(made)
        return emitted

    def _accept(self, p: _Plan, logits: torch.Tensor) -> list[int]:
        """The tokens the plan makes: its kept draft tokens, then the target's own (a replacement or one more)."""
        params, rid = p.seq.params, p.seq.request_id
        if params.temperature == 0.0:
            target = logits.argmax(dim=-1).tolist()
            made = []
            for d, t in zip(p.drafts, target, strict=False):
                if d != t:
                    break
                made.append(d)
            return [*made, target[len(made)]]
        gen = self.sampler.generator(rid, params)
        made = []
        for i, d in enumerate(p.drafts):
            probs, q = Sampler.distribution(logits[i], params), p.draft_probs[i]
            assert q is not None
            if float(torch.rand((), generator=gen)) * float(q[d]) <= float(probs[d]):
                made.append(d)
                continue
            residual = (probs - q).clamp_min(0.0)
            total = float(residual.sum())
            pick = residual / total if total > 0 else probs
            return [*made, Sampler.draw(pick, gen)]
        probs = Sampler.distribution(logits[p.k], params)
        return [*made, Sampler.draw(probs, gen)]
