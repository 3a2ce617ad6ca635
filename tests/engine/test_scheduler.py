"""The scheduler with no model: token budget, chunked prefill, priority, preemption, finishing."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request_queue import SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import (
    DECODE_COST,
    MIN_SHARED_CHUNK,
    SHARED_STEP_COST,
    Scheduler,
)
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.tenant_shares import CONTEXT_COST_TOKENS

EOS = 0


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 16, max_num_seqs: int = 8,
         policy: SchedulingPolicy = SchedulingPolicy.PRIORITY) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=1024, eos_token_ids={EOS}, policy=policy)


def seq(rid: str, n: int, *, max_tokens: int = 4, priority: int = 0, t: float = 0.0,
        salt: str | None = None, first: int = 1) -> Sequence:
    """Prompt tokens first .. first + n - 1 (the same `first` shares a prefix in the cache, within one salt)."""
    return Sequence(rid, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=max_tokens),
                    priority=priority, arrival_time=t, cache_salt=salt)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.postprocess(out, [token] * sum(out.do_sample))
    return out


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(out.seqs, out.num_scheduled_tokens, strict=True)}


def test_a_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    sched = make(budget=16)
    sched.add_request(seq("short", 3, max_tokens=10, t=0))
    assert scheduled(step(sched)) == {"short": 3}
    sched.add_request(seq("long", 40, t=1))
    outs = [step(sched) for _ in range(3)]
    assert [scheduled(o) for o in outs] == [{"short": 1, "long": 15}, {"short": 1, "long": 15},
                                            {"short": 1, "long": 10}]
    assert outs[2].do_sample == [True, True] and not outs[0].do_sample[1]  # "long" samples only at its end
    assert sched.running[1].num_output_tokens == 1


def test_finishing_by_eos_and_by_max_tokens_frees_blocks() -> None:
    sched = make()
    sched.add_request(seq("a", 5, max_tokens=2))
    sched.add_request(seq("b", 5, max_tokens=9))
    step(sched)
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.seqs}
    sched.postprocess(out, [7, EOS])
    assert by_id["a"].finish_reason == "length" and by_id["b"].finish_reason == "stop"
    assert by_id["a"].output_token_ids == [7, 7] and by_id["b"].output_token_ids == [7, EOS]
    assert not sched.has_unfinished_requests() and sched.block_manager.num_free_blocks == 64


def test_waiting_sequences_are_admitted_by_priority_then_arrival() -> None:
    sched = make(max_num_seqs=1)
    for rid, prio, t in (("late-low", 5, 1.0), ("early-low", 5, 0.5), ("high", 0, 2.0)):
        sched.add_request(seq(rid, 2, max_tokens=1, priority=prio, t=t))
    order = [next(iter(scheduled(step(sched)))) for _ in range(3)]
    assert order == ["high", "early-low", "late-low"]


def test_fcfs_policy_ignores_priority() -> None:
    sched = make(max_num_seqs=1, policy=SchedulingPolicy.FCFS)
    sched.add_request(seq("first", 2, max_tokens=1, priority=9))
    sched.add_request(seq("second", 2, max_tokens=1, priority=0))
    assert [next(iter(scheduled(step(sched)))) for _ in range(2)] == ["first", "second"]


def test_running_out_of_blocks_preempts_the_lowest_ranked_and_it_resumes() -> None:
    sched = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, max_tokens=6, t=0), seq("b", 7, max_tokens=6, t=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)  # each holds 2 blocks (8 tokens computed); the cache is full
    step(sched)  # token 9 of each needs a third block: b, the later arrival, is preempted
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == [] and sched.num_preemptions_total == 1
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7]
    while sched.has_unfinished_requests():
        step(sched)
    # b was readmitted, found its own 8 computed tokens still cached, recomputed the rest and went on
    assert b.num_cached_tokens == 8 and b.output_token_ids == [7] * 6 and a.output_token_ids == [7] * 6
    assert sched.block_manager.num_free_blocks == 4


def test_a_higher_priority_arrival_preempts_a_lower_priority_runner() -> None:
    sched = make(num_blocks=3, block_size=4, budget=64)
    low = seq("low", 9, max_tokens=3, priority=5)
    sched.add_request(low)
    step(sched)
    sched.add_request(seq("urgent", 5, max_tokens=2, priority=0, t=1))
    out = step(sched)
    assert list(scheduled(out)) == ["urgent"] and low.status is SequenceStatus.PREEMPTED


def test_abort_while_waiting_or_running_frees_everything() -> None:
    sched = make(max_num_seqs=1)
    a, b = seq("a", 9, max_tokens=50), seq("b", 9, max_tokens=50, t=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert not sched.has_unfinished_requests() and sched.block_manager.num_free_blocks == 64
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")


def test_a_follow_up_turn_is_admitted_with_its_cached_prefix() -> None:
    sched = make(budget=64)
    first = seq("turn-1", 20, max_tokens=3)
    sched.add_request(first)
    while sched.has_unfinished_requests():
        step(sched)
    follow = Sequence("turn-2", [*first.token_ids, 40, 41, 42], SamplingParams(temperature=0, max_tokens=2))
    sched.add_request(follow)
    out = step(sched)
    assert follow.num_cached_tokens == 20 and scheduled(out) == {"turn-2": follow.num_prompt_tokens - 20}


def test_a_long_prompt_leaves_part_of_each_step_to_those_behind_it() -> None:
    """Before, an earlier long prompt took every step's whole budget: a later sequence's decode and a short
    prompt's admission waited until it was read (one tenant's long prompts stalled everyone's short requests)."""
    sched = make(budget=16, num_blocks=256)  # shared: half the budget, 8 tokens
    sched.add_request(seq("long", 60, t=0))
    assert scheduled(step(sched)) == {"long": 16}  # alone: the whole budget
    sched.add_request(seq("short", 3, max_tokens=10, t=1))
    assert scheduled(step(sched)) == {"long": 8, "short": 3}  # admitted beside it at once
    assert scheduled(step(sched)) == {"long": 8, "short": 1}  # and decoding while it is read
    sched.add_request(seq("long2", 60, t=2))
    sched.add_request(seq("short2", 2, t=3))
    first, second = scheduled(step(sched)), scheduled(step(sched))
    for got in (first, second):
        assert got["long"] <= 8 and got["short"] == 1  # the first long prompt shares; the decode goes on
    assert "short2" in first or "short2" in second  # admitted while two long prompts are being read


# ---- tenants (a tenant is a cache salt; no salt is a tenant of its own) ----

def engine_like(max_num_seqs: int = 16) -> Scheduler:
    """The engines' budget (512 tokens a step), with room for a dozen 1,500-token prompts."""
    return make(num_blocks=2048, block_size=16, budget=512, max_num_seqs=max_num_seqs)


def prompt_tokens(out: SchedulerOutput, salt: str | None) -> int:
    """The tokens of `salt`'s prompt chunks in a step (a decode, one token at a prompt's end, is not one)."""
    return sum(n for s, n in zip(out.seqs, out.num_scheduled_tokens, strict=True) if s.cache_salt == salt and n > 1)


def test_one_tenants_long_prompts_keep_the_step_short_while_another_tenant_decodes() -> None:
    """Before, one tenant's eight 1,500-token prompts filled every step with 384-512 tokens of prompt (~0.5-1 s on one
    core) and another tenant's short request made one token a step: its p50 went from 0.11 s alone to 5.3-7.6 s."""
    sched = engine_like()
    for k in range(8):
        sched.add_request(seq(f"long{k}", 1500, max_tokens=16, t=k, salt="attacker", first=10_000 * (k + 1)))
    assert prompt_tokens(step(sched), "attacker") == 512  # alone, the whole budget
    victim = seq("victim", 20, max_tokens=8, t=100, salt="victim")
    sched.add_request(victim)
    outs = []
    while not victim.is_finished:
        outs.append(step(sched))
        assert victim in outs[-1].seqs  # admitted at once, then a token every step
        assert prompt_tokens(outs[-1], "attacker") <= SHARED_STEP_COST  # ~0.07 s of prompt, not 0.5-1 s
    assert len(outs) == 8 and scheduled(outs[0])["victim"] == 20
    assert prompt_tokens(step(sched), "attacker") == 512  # gone: the whole budget again


def test_a_tenants_share_costs_more_late_in_a_long_prompt() -> None:
    """A prompt token read after c earlier ones costs 1 + c / CONTEXT_COST_TOKENS: a share buys fewer of them, so the
    step stays as short late in a long prompt as early (reading after 1,500 tokens costs ~2.5x on one core)."""
    sched = engine_like()
    sched.add_request(seq("victim", 2, max_tokens=100, salt="victim"))
    step(sched)  # the victim decodes from now on
    long = seq("long", 4000, max_tokens=1, t=1, salt="attacker")
    sched.add_request(long)
    got = []
    while long.num_computed_tokens < 2500:
        before = long.num_computed_tokens
        got.append((before, scheduled(step(sched))["long"]))
    for context, n in got:
        assert n == max(MIN_SHARED_CHUNK, SHARED_STEP_COST * CONTEXT_COST_TOKENS // (CONTEXT_COST_TOKENS + context))
    assert got[0][1] == SHARED_STEP_COST and got[-1][1] == MIN_SHARED_CHUNK  # never cut below the least chunk


def test_a_waiting_tenant_is_admitted_before_another_tenants_queue() -> None:
    """Before, a tenant's queued prompts went first: another tenant's request waited for all of them to be admitted."""
    sched = engine_like()
    for k in range(8):
        sched.add_request(seq(f"long{k}", 1500, max_tokens=16, t=k, salt="attacker", first=10_000 * (k + 1)))
    step(sched)
    sched.add_request(seq("victim", 20, max_tokens=8, t=100, salt="victim"))
    assert "victim" in scheduled(step(sched))


def test_tenants_reading_long_prompts_share_each_step() -> None:
    """A second tenant's long prompt is read beside the first's, not after them."""
    sched = engine_like()
    for k in range(4):
        sched.add_request(seq(f"a{k}", 1500, max_tokens=1, t=k, salt="a", first=10_000 * (k + 1)))
    step(sched)
    late = seq("b", 600, max_tokens=1, t=10, salt="b")
    sched.add_request(late)
    steps = 0
    while not late.is_finished:
        left = late.num_prompt_tokens - late.num_computed_tokens
        out = step(sched)
        steps += 1
        assert scheduled(out)["b"] >= min(MIN_SHARED_CHUNK, left)  # every step, what its share buys
        assert prompt_tokens(out, "a") <= max(MIN_SHARED_CHUNK, SHARED_STEP_COST // 2)
    assert steps <= 600 // MIN_SHARED_CHUNK + 1


def test_no_salt_is_a_tenant_of_its_own() -> None:
    sched = engine_like()
    sched.add_request(seq("plain", 2, max_tokens=50))
    step(sched)
    sched.add_request(seq("long", 1500, t=1, salt="a"))
    assert prompt_tokens(step(sched), "a") <= SHARED_STEP_COST


def test_a_lower_priority_tenant_never_holds_a_higher_priority_prompt_back() -> None:
    sched = engine_like()
    sched.add_request(seq("batch", 2, max_tokens=50, priority=2, salt="b"))
    step(sched)
    sched.add_request(seq("interactive", 1500, priority=0, t=1, salt="i"))
    assert prompt_tokens(step(sched), "i") == 511  # the budget but the batch tenant's decode
    sched.add_request(seq("batch-long", 1500, priority=2, t=2, salt="b"))
    sched.add_request(seq("interactive-short", 2, max_tokens=50, priority=0, t=3, salt="i2"))
    step(sched)
    for _ in range(3):  # now the batch tenant's prompt is held for the interactive tenants' decodes
        assert prompt_tokens(step(sched), "b") <= SHARED_STEP_COST


def test_many_decodes_of_one_tenant_leave_another_tenants_prompt_as_much_of_the_step() -> None:
    """A held prompt may cost as much as the step's decodes: twenty decodes (~0.1 s a step) cannot shrink another
    tenant's prompt to SHARED_STEP_COST a step (~0.06 s)."""
    sched = make(num_blocks=2048, block_size=16, budget=512, max_num_seqs=32)
    for k in range(20):
        sched.add_request(seq(f"gen{k}", 2, max_tokens=100, t=k, salt="a", first=10 * (k + 1)))
    step(sched)
    sched.add_request(seq("long", 1500, max_tokens=1, t=100, salt="b"))
    assert scheduled(step(sched))["long"] == 20 * DECODE_COST > SHARED_STEP_COST


def test_a_tenant_whose_share_is_spent_at_a_long_cached_context_does_not_stop_anothers_admission() -> None:
    """A share with a token's cost left at the start of a prompt grants nothing 1,000 cached tokens in: that tenant's
    sequence waits for the next step, and another tenant's behind it is still admitted in this one."""
    sched = make(num_blocks=600, block_size=4, budget=512)
    sched.add_request(seq("a0", 1000, max_tokens=1, salt="A", first=1000))
    while sched.has_unfinished_requests():  # read and answered: its blocks stay in the prefix cache
        step(sched)
    sched.add_request(seq("b0", 4, max_tokens=20, salt="B", first=5000))
    step(sched)  # b0's prompt, alone: it decodes from now on
    sched.add_request(seq("a1", 53, salt="A", t=1, first=9000))  # A's share: 54 of 64, less B's 10
    sched.add_request(seq("a2", 1008, salt="A", t=2, first=1000))  # a0's 1,000 tokens cached, then 8 more
    sched.add_request(seq("b1", 10, salt="B", t=3, first=7000))
    got = scheduled(step(sched))
    assert got["a1"] == 53 and got["b0"] == 1 and "a2" not in got
    assert got["b1"] == 10  # admitted although a2, ahead of it, got nothing


# ---- running slots between tenants ----

def num_running(sched: Scheduler) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for s in sched.running:
        counts[s.cache_salt] = counts.get(s.cache_salt, 0) + 1
    return counts


def test_a_tenant_holding_every_slot_hands_one_to_another_tenant_at_once() -> None:
    """Before, one tenant's long generations held every running slot and another tenant's request waited for one of
    them to finish, however fair admission was (2.6-3.5 s on SmolLM2, 8 slots of 256-token answers, 2 cores)."""
    sched = make(max_num_seqs=4, budget=64, num_blocks=256)
    attackers = [seq(f"a{k}", 4, max_tokens=100, t=k, salt="attacker", first=10 * (k + 1)) for k in range(4)]
    for s in attackers:
        sched.add_request(s)
    step(sched)
    step(sched)
    victim = seq("victim", 4, max_tokens=3, t=10, salt="victim", first=500)
    low = seq("batch", 4, max_tokens=3, priority=5, t=11, salt="batch", first=600)  # a lower priority takes none
    sched.add_request(victim)
    sched.add_request(low)
    out = step(sched)
    assert scheduled(out)["victim"] == 4 and attackers[-1] not in out.seqs  # the youngest gave its slot up
    assert attackers[-1].status is SequenceStatus.PREEMPTED and attackers[-1].num_preemptions == 1
    while not victim.is_finished:
        step(sched)
    assert all(a.num_output_tokens < 10 for a in attackers)  # done long before any attacker's generation
    while not attackers[0].is_finished:
        step(sched)
        assert low.num_computed_tokens == 0  # no preemption for a tenant of a lower priority
    while sched.has_unfinished_requests():
        step(sched)
    assert [a.output_token_ids for a in attackers] == [[7] * 100] * 4  # the preempted one resumed where it was
    assert sched.num_preemptions_total == 1 and sched.block_manager.num_free_blocks == 256


def test_slots_even_out_between_tenants_and_a_lone_tenant_uses_them_all() -> None:
    sched = make(max_num_seqs=8, budget=64, num_blocks=256)
    for k in range(12):
        sched.add_request(seq(f"a{k}", 4, max_tokens=50, t=k, salt="A", first=10 * (k + 1)))
    step(sched)
    assert num_running(sched) == {"A": 8}  # alone: every slot
    victims = [seq(f"v{k}", 4, max_tokens=5, t=100 + k, salt="V", first=1000 + 10 * k) for k in range(6)]
    for s in victims:
        sched.add_request(s)
    step(sched)
    assert num_running(sched) == {"A": 4, "V": 4}  # a fair share each, in one step
    for _ in range(12):
        step(sched)
    assert all(v.is_finished for v in victims)
    step(sched)
    assert num_running(sched) == {"A": 8}  # alone again: every slot again


def test_a_tenants_end_users_take_one_tenants_share_of_the_slots() -> None:
    """The gateway salts an isolating plan's end users apart (`<tenant>.<end user>`): the prefix cache is theirs
    alone, but the slots are still shared by tenant (before, each end user's salt took a tenant's share)."""
    sched = make(max_num_seqs=8, budget=64, num_blocks=256)
    for k in range(12):
        sched.add_request(seq(f"a{k}", 4, max_tokens=50, t=k, salt=f"A.user{k}", first=10 * (k + 1)))
    for k in range(6):
        sched.add_request(seq(f"v{k}", 4, max_tokens=5, t=100 + k, salt="V", first=1000 + 10 * k))
    step(sched)
    step(sched)
    running: dict[str | None, int] = {}
    for s in sched.running:
        running[s.tenant] = running.get(s.tenant, 0) + 1
    assert running == {"A": 4, "V": 4}


def test_a_slot_another_tenant_needs_is_not_given_away_beyond_a_fair_share() -> None:
    """With a slot free and another tenant's request waiting (its tenant's prompt share spent this step), a tenant
    at its fair share is not admitted: it would take the slot and lose it to a preemption the step after, each step."""
    sched = engine_like(max_num_seqs=4)
    for k in range(2):
        sched.add_request(seq(f"a{k}", 2, max_tokens=100, t=k, salt="A", first=10 * (k + 1)))
    step(sched)
    sched.add_request(seq("v0", 1500, max_tokens=1, t=10, salt="V", first=10_000))
    step(sched)
    late_a = seq("a2", 1, max_tokens=100, t=11, salt="A", first=500)
    late_v = seq("v1", 1500, max_tokens=1, t=12, salt="V", first=20_000)
    sched.add_request(late_a)
    sched.add_request(late_v)
    while late_v.status is not SequenceStatus.RUNNING:
        assert len(sched.running) == 3  # the free slot is kept for v1 ...
        assert late_a not in step(sched).seqs  # ... and a2 does not take it
    assert num_running(sched) == {"A": 2, "V": 2} and sched.num_preemptions_total == 0
