"""Decides, each step, which sequences run and how many of their tokens: continuous batching, fair between tenants.

Pure Python over the block manager, so it is tested without a model. Each step has a token budget
(`max_num_batched_tokens`): running sequences go first (a decode costs one token, an unfinished prompt
takes the rest of the budget as a chunk), then waiting ones are admitted by policy while blocks, slots
and budget last. A long prompt is therefore cut into chunks instead of stalling everyone's decode. While
other sequences wait behind it (later running ones, or waiting ones), a prompt's chunk leaves SHARED_TOKENS of
the budget to them: their decodes and a short prompt's admission go on in the same step.

Tenants. A sequence's tenant is its prefix-cache salt's tenant (the gateway's per-tenant digest, before any end
user's part: sequence.salt_tenant; no salt is a tenant of its own). A sequence makes one token a step, and on one
core a step costs ~1 ms a prompt token (2.5 ms late in a 1,500-token prompt) against 3-7 ms a decode, so with one
tenant's prompts filling every step (384-512 tokens, 0.5-1 s) another tenant's short request (8 tokens) took 5.3-7.6
s at p50 against 0.11 s alone, under eight 1,500-token prompts through the gateway. While more than one tenant has
sequences here, a step's prompt chunks together cost at most SHARED_STEP_COST (or as much as the step's decodes,
DECODE_COST each, if more), where a prompt token read after c others costs 1 + c / CONTEXT_COST_TOKENS; that cost is
shared equally among the tenants with prompts to read (one that needs less leaves the rest to the others), a
tenant's first chunk of the step is never cut below MIN_SHARED_CHUNK tokens, and among waiting sequences of the
head's priority the tenant with the fewest running ones is admitted first. A tenant's prompts are held so only for
another tenant with a sequence of the same or a higher priority. A tenant alone here keeps the whole budget.
Measured through the gateway: the steps beside the victim take 0.08 s on average (0.5-0.6 s before), and its p50
under the eight prompts is 1.0-1.05 s (p95 1.35 s), most of the rest being the in-flight step it arrives behind.
What the shorter steps cost the tenant with the long prompts is measured at SHARED_STEP_COST;
tests/engine/test_scheduler.py pins the policy.

Running slots are shared too: one tenant's long answers filling the batch (max_num_seqs) held another tenant's request
until one ended (SmolLM2, 8 slots of 256-token answers, 2 cores: first token after 2.6-3.5 s; now 0.03-0.05 s). While
tenants wait, one is admitted beyond its fair share (max_num_seqs over the tenants here, rounded up) only into slots
the others do not need to reach theirs; in a full batch, a waiting tenant running two or more sequences fewer than
the tenant running the most takes a slot from it (its lowest-ranked sequence is preempted). Alone, a tenant takes all.

When blocks run out, the lowest-priority running sequence is preempted: its blocks are freed and it
waits to be recomputed from its tokens (its own freed blocks usually come back as prefix-cache hits).
A waiting sequence of higher priority than a running one may preempt it the same way, and so may a waiting tenant
short of running sequences (above) one of the same or a lower priority. Greedy output is unchanged by a preemption.

The shares' arithmetic (a prompt's cost, the equal split, what a tenant may still spend) is engine/tenant_shares.py;
what a step hands the runner, engine/scheduler_output.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from engine.block_manager import BlockManager
from engine.request_queue import SchedulingPolicy, create_request_queue
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.tenant_shares import Tenant, TenantShares, prompt_cost, water_fill

SHARED_TOKENS = 128  # a short prompt, or the decodes of every running sequence
# While more than one tenant has sequences in the engine, the prompt chunks of one step cost at most this many
# prompt tokens read at a prompt's start (~0.9 ms each on one core, mid or full): with the decodes beside them, a
# step of 0.08 s. Measured in one engine (mid, full), a victim's requests sent one after another throughout another
# tenant's four 1,530-token prompts: at 64, the victim's p50 0.57-0.63 s and the prompts done in 11.9-13.8 s (21
# victim requests done); at 96, 0.76 s and 11.2-11.6 s (16); at 128, 0.96-0.99 s and 10.5-11.5 s (13); before,
# 1.8-2.1 s (p95 7.1 s) and 9.3-10.4 s (4). Alone, the prompts take 9.5-10.5 s either way
SHARED_STEP_COST = 64
# A tenant's first chunk in a shared step is never cut below this many tokens: reading late in a long prompt, each
# chunk first gathers its whole context, so smaller chunks cost more in all (1,536 tokens in chunks of 32: 2.7-2.8 s
# on one core against 2.1-2.5 s in chunks of 64 to 512; 3,000 tokens: 8.5-9.8 s against 6.2-6.8 s in chunks of 512)
MIN_SHARED_CHUNK = 32
# A decode costs about as much as this many prompt tokens read at a prompt's start (measured on one core, in steps of
# 1 to 4 decodes at 1,540 tokens of context: 3-5 ms more a decode on full, 6.5-7 ms on mid, against ~1 ms). Held
# prompts may cost as much as the step's decodes together, when that is more than SHARED_STEP_COST: one tenant's
# many decodes cannot shrink another tenant's prompt reading to a sliver of each step
DECODE_COST = 6

class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int],
                 policy: SchedulingPolicy = SchedulingPolicy.PRIORITY) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.policy = policy
        self.waiting = create_request_queue(policy)
        self.running: list[Sequence] = []
        # what a prompt's chunk leaves of a step's budget while others wait behind it
        self.shared_tokens = min(SHARED_TOKENS, max_num_batched_tokens // 2)
        # while tenants share the engine: what a step's prompt chunks may cost, and a tenant's least chunk
        self.shared_step_cost = min(SHARED_STEP_COST, max_num_batched_tokens)
        self.min_shared_chunk = min(MIN_SHARED_CHUNK, self.shared_step_cost)
        self.num_preemptions_total = 0

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add_request(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=_rank)
        if self.policy is SchedulingPolicy.PRIORITY:
            self._preempt_for_waiting(out)
        self._preempt_for_tenants(out)
        shares = self._tenant_shares()
        # running sequences first: decodes and the next chunk of unfinished prompts
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            key = self._key(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            chunk = n > 1
            if chunk and shares.holds(key):  # its tenant's share of the step
                n = shares.grant(key, n, seq.num_computed_tokens)
            elif chunk and (i + 1 < len(self.running) or len(self.waiting)):  # a chunk, with others behind it
                n = min(n, budget - self.shared_tokens)
            if n < 1:  # this step's budget is theirs now
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()  # the lowest-ranked; never one already scheduled (they rank higher)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                if chunk:
                    shares.charge(key, n, seq.num_computed_tokens)
                self._add(out, seq, n)
                budget -= n
                i += 1
        # then admit waiting sequences while slots, blocks and budget last (none if this step preempted)
        passed: set[int] = set()  # ids of waiting sequences whose tenant's share leaves them nothing this step
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self._next_waiting(shares, passed)
            if seq is None:
                break
            key = self._key(seq)
            hits = self.block_manager.get_computed_blocks(seq)
            cached = len(hits) * self.block_manager.block_size
            n = min(seq.num_tokens - cached, budget)
            chunk = n > 1
            if chunk and shares.holds(key):
                n = shares.grant(key, n, cached)
            if n < 1:  # its share is spent at this context: another tenant's may still be admitted
                passed.add(id(seq))
                continue
            if not self.block_manager.allocate_slots(seq, n, hits):
                break
            if seq is self.waiting.peek_request():
                self.waiting.pop_request()
            else:  # a tenant with fewer running sequences goes before one with more (_next_waiting)
                self.waiting.remove_request(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            shares.num_running[seq.tenant] += 1
            shares.num_waiting[seq.tenant] -= 1
            if chunk:
                shares.charge(key, n, cached)
            self._add(out, seq, n)
            budget -= n
        return out

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[tuple[Sequence, int]]:
        """Advance computed counts, append sampled tokens, finish sequences that hit EOS or a length cap.

        `token_ids` has one token per sequence with `do_sample` set, in batch order. Returns those
        (sequence, token) pairs; finished sequences have already released their blocks.
        """
        sampled = iter(token_ids)
        made: list[tuple[Sequence, int]] = []
        for seq, n, do_sample in zip(out.seqs, out.num_scheduled_tokens, out.do_sample, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if not do_sample:
                continue
            token_id = next(sampled)
            self.append_token(seq, token_id)
            made.append((seq, token_id))
        return made

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Add one made token to `seq`; finish it at EOS or at its length cap."""
        seq.output_token_ids.append(token_id)
        if token_id in self.eos_token_ids and not seq.params.ignore_eos:
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")

    def computed_up_to(self, seq: Sequence, num_tokens: int) -> None:
        """Mark the first `num_tokens` of `seq` computed (a speculative step computes several) and cache its blocks."""
        seq.num_computed_tokens = num_tokens
        self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove_request(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- helpers ----

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_scheduled_tokens.append(n)
        out.do_sample.append(seq.num_computed_tokens + n == seq.num_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend_request(seq)
        out.preempted.append(seq)

    def _admissible(self) -> Iterator[Sequence]:
        """Waiting sequences that may be admitted next, in queue order: those of the head's priority (all for FCFS)."""
        if not len(self.waiting):
            return
        head = self.waiting.peek_request()
        for seq in self.waiting:
            if self.policy is SchedulingPolicy.PRIORITY and seq.priority != head.priority:
                return
            yield seq

    def _tenant_shares(self) -> TenantShares:
        """This step's prompt cost per tenant and priority, while more than one tenant has sequences here.

        A tenant's prompts of some priority are held to a share only for the sake of another tenant with a sequence
        of that priority or a higher one (a lower-priority decode never slows a higher-priority prompt). Shares are
        filled from the step's SHARED_STEP_COST (or its decodes' cost, if more) priority by priority, the highest first.
        """
        waiting = list(self._admissible()) if len(self.running) < self.max_num_seqs else []
        best: dict[Tenant, int] = {}  # each tenant's highest priority here (its lowest number)
        demand: dict[int, dict[Tenant, float]] = {}  # per priority, each tenant's prompt cost, in rank then queue order
        num_decodes = 0
        for seq in self.running + waiting:  # a waiting sequence has computed nothing yet
            tenant, level = self._key(seq)
            best[tenant] = min(best.get(tenant, level), level)
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1:
                per_tenant = demand.setdefault(level, {})
                per_tenant[tenant] = per_tenant.get(tenant, 0.0) + prompt_cost(left, seq.num_computed_tokens)
            else:
                num_decodes += 1
        shares = TenantShares(len(best) > 1, Counter(seq.tenant for seq in self.running),
                         Counter(seq.tenant for seq in waiting), -(-self.max_num_seqs // max(1, len(best))),
                         self.min_shared_chunk)
        if not shares.shared:
            return shares
        total = float(max(self.shared_step_cost, DECODE_COST * num_decodes))
        for level in sorted(demand):
            held = {tenant: cost for tenant, cost in demand[level].items()
                    if any(b <= level for other, b in best.items() if other != tenant)}
            for tenant, share in water_fill(held, total).items():
                shares.left[tenant, level] = share
                total -= share
        return shares

    def _key(self, seq: Sequence) -> tuple[Tenant, int]:
        """Its tenant and its priority (all one priority under FCFS)."""
        return seq.tenant, seq.priority if self.policy is SchedulingPolicy.PRIORITY else 0

    def _next_waiting(self, shares: TenantShares, passed: set[int]) -> Sequence | None:
        """The waiting sequence to admit next: the head; while tenants share the engine, the first (of the head's
        priority) of the tenant with the fewest running sequences, among those whose share is not spent, whose
        tenant may take a slot (`TenantShares.may_admit`) and not `passed` over this step."""
        if not shares.shared:
            head = self.waiting.peek_request()
            return None if id(head) in passed else head
        best, fewest = None, 0
        num_free_slots = self.max_num_seqs - len(self.running)
        for seq in self._admissible():
            load = shares.num_running[seq.tenant]
            if (id(seq) not in passed and shares.can_take(self._key(seq)) and (best is None or load < fewest)
                    and shares.may_admit(seq.tenant, num_free_slots)):
                best, fewest = seq, load
        return best

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Make room for a waiting sequence that outranks the lowest-ranked running one."""
        while len(self.waiting) and self.running:
            head, lowest = self.waiting.peek_request(), self.running[-1]
            if head.priority >= lowest.priority:
                return
            full = len(self.running) >= self.max_num_seqs
            hits = self.block_manager.get_computed_blocks(head)
            first_chunk = min(head.num_tokens - len(hits) * self.block_manager.block_size,
                              self.max_num_batched_tokens)
            needed = self.block_manager.num_blocks_for(len(hits) * self.block_manager.block_size + first_chunk)
            if not full and needed - len(hits) <= self.block_manager.num_free_blocks:
                return
            self.running.pop()
            self._preempt(lowest, out)
            out.preempted.remove(lowest)  # a priority swap; newcomers may still be admitted this step

    def _preempt_for_tenants(self, out: SchedulerOutput) -> None:
        """Make room in a full batch for waiting tenants: while the waiting tenant (of the head's priority) with the
        fewest running sequences runs two or more fewer than the tenant running the most, that tenant's lowest-ranked
        sequence is preempted, one for each waiting sequence, never one of a higher priority than the head's."""
        if len(self.running) < self.max_num_seqs or not len(self.waiting):
            return
        level = self.waiting.peek_request().priority
        num_running = Counter(seq.tenant for seq in self.running)
        num_waiting = Counter(seq.tenant for seq in self._admissible())  # tenants in queue order
        while num_waiting:
            tenant = min(num_waiting, key=num_running.__getitem__)  # the first in the queue among equals
            most = max(num_running.values())
            if most < num_running[tenant] + 2:  # a swap would not even the counts out
                return
            victim = next(seq for seq in reversed(self.running) if num_running[seq.tenant] == most)
            if self.policy is SchedulingPolicy.PRIORITY and victim.priority < level:
                return
            self.running.remove(victim)
            self._preempt(victim, out)
            out.preempted.remove(victim)  # a slot handed over; newcomers are admitted this step
            num_running[victim.tenant] -= 1
            num_running[tenant] += 1
            num_waiting[tenant] -= 1
            if not num_waiting[tenant]:
                del num_waiting[tenant]


def _rank(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.arrival_time
