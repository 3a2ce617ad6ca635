"""A tenant that steers its own requests cannot decide a rollout's guards; a candidate worse for everyone still
rolls back.

A client sees each answer's version (`x-tiergate-model-version`) and names its conversation (`x-tiergate-session`):
it can probe sessions with cheap requests, keep those the candidate answers, and send only its expensive requests
there. Its outcomes then say what it wants; the guards must judge the candidate on what the other tenants' traffic
says too. Assignment here is the real one (`RolloutService.choose`), outcomes are recorded as settle records them.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from gateway.rollout.assign import conversation_id
from gateway.rollout.guards import MAX_SAMPLES, Guards, Ranked, Rings, Side, Window, band, judge, p95
from gateway.rollout.service import RolloutService
from gateway.rollout.state import SqliteRolloutStore
from tests.gateway.rollout.test_service import CATALOGUE

MID = CATALOGUE.tiers["mid"]
FAST, SLOW = 0.012, 0.2  # seconds to the first token: the stub's ordinary answer, and its `STUB:slow` one


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def service(tmp_path: Path) -> RolloutService:
    return RolloutService(CATALOGUE, SqliteRolloutStore(tmp_path / "state.db"), clock=Clock())


def version(s: RolloutService, tenant: str, conversation: str) -> str:
    spec, _ = s.choose(MID, tenant, lambda: conversation)
    assert spec.version_name is not None
    return spec.version_name


def ask(s: RolloutService, tenant: str, conversation: str, ttft_s: float, *, error: bool = False,
        prompt_tokens: int = 20) -> str:
    """One request of `tenant` in `conversation`, answered in `ttft_s`: the version that answered it."""
    v = version(s, tenant, conversation)
    s.observe("mid", v, error=error, ttft_s=ttft_s, tpot_s=0.01, tenant=tenant, prompt_tokens=prompt_tokens)
    return v


def ordinary(s: RolloutService, tenant: str, n: int, *, v2_ttft_s: float = FAST, v2_errors: bool = False) -> dict[
        str, int]:
    """`n` new conversations of `tenant`, split by the canary; how many each version answered."""
    rng = random.Random(tenant)
    seen = {"v1": 0, "v2": 0}
    for i in range(n):
        conv = conversation_id(tenant, [{"role": "user", "content": f"{tenant} question {i}"}])
        on_v2 = version(s, tenant, conv) == "v2"
        jitter = rng.uniform(0.9, 1.1)
        seen[ask(s, tenant, conv, (v2_ttft_s if on_v2 else FAST) * jitter, error=on_v2 and v2_errors)] += 1
    return seen


def candidate_sessions(s: RolloutService, tenant: str, want: int) -> list[str]:
    """What the attacker does: probe sessions with cheap requests, keep those the candidate answers."""
    found = []
    for i in range(5000):
        conv = conversation_id(tenant, [{"role": "user", "content": "hi"}], f"s{i}")
        if ask(s, tenant, conv, FAST / 2, prompt_tokens=9) == "v2":
            found.append(conv)
            if len(found) == want:
                return found
    raise AssertionError("no session on the candidate")


def tick(s: RolloutService, seconds: float) -> str:
    s.clock.now += seconds  # type: ignore[attr-defined]
    s.evaluate()
    return s.status()[0]["stage"]


def run_guards(s: RolloutService, seconds: int = 20) -> str:
    stage = "canary"
    for _ in range(seconds):
        stage = tick(s, 1)
        if stage != "canary":
            break
    return stage


def start(s: RolloutService) -> None:
    s.start("mid", "v2", share=0.1, who="k", reason="canary of v2", guards=Guards(breach_for_s=5))


def test_one_tenant_steering_its_slow_requests_onto_the_canary_does_not_roll_it_back(service: RolloutService) -> None:
    start(service)
    victim = ordinary(service, "victim", 300)
    assert victim["v2"] >= 10
    for i, conv in enumerate(candidate_sessions(service, "attacker", 4) * 18):  # 72 slow requests, all on v2
        assert ask(service, "attacker", conv, SLOW * (1 + i / 1000)) == "v2"
    assert run_guards(service) == "canary"
    guard = service.status()[0]["guard"]
    assert guard["breached"] == []
    assert len(guard["held"]) == 1 and guard["held"][0].startswith("max_ttft_p95_ratio: ")
    assert "held by tenant 'attacker' alone" in guard["held"][0]
    assert guard["versions"]["v2"]["tenants"] == 2


def test_one_tenant_steering_server_errors_onto_the_canary_does_not_roll_it_back(service: RolloutService) -> None:
    start(service)
    # 600 conversations, ~60 on the canary (the rollout's id, drawn at random, salts the buckets): with the attacker's
    # 3 probes and 30 errors there, the candidate has the guards' 50 requests to judge; with 300 the victim had 16 or
    # fewer on v2, and nothing was judged, in 0.27% of runs (binomial)
    victim = ordinary(service, "victim", 600)
    for conv in candidate_sessions(service, "attacker", 3) * 10:  # requests that fail on any version, sent to v2
        ask(service, "attacker", conv, FAST, error=True)
    assert victim["v2"] + 3 + 30 >= Guards().min_requests
    assert run_guards(service) == "canary"
    assert service.status()[0]["guard"]["held"][0].startswith("max_error_rate: ")


def test_one_tenants_flood_cannot_push_the_others_outcomes_out_of_the_window(service: RolloutService) -> None:
    """The window kept its newest 4,096 outcomes whoever's they were: a tenant sending that many slow requests to the
    candidate pushed every other tenant's out, and then judged alone as if it were the tier's only tenant. Past the
    bound, the tenant holding the most now gives up its own oldest."""
    start(service)
    victim = ordinary(service, "victim", 300)
    assert victim["v2"] >= 10
    for i, conv in enumerate(candidate_sessions(service, "attacker", 4) * 1100):  # 4,400 slow requests, all on v2
        assert ask(service, "attacker", conv, SLOW * (1 + i / 10_000)) == "v2"
    assert run_guards(service) == "canary"
    guard = service.status()[0]["guard"]
    assert "held by tenant 'attacker' alone" in guard["held"][0]
    assert guard["versions"]["v2"]["requests"] <= MAX_SAMPLES and guard["versions"]["v2"]["tenants"] == 2


def test_a_window_past_its_bound_takes_from_the_tenant_holding_the_most() -> None:
    window = Window()
    for i in range(30):
        window.add(float(i), error=False, ttft_s=0.1, tpot_s=None, tenant="quiet")
    for i in range(MAX_SAMPLES * 2):
        window.add(100.0 + i, error=True, ttft_s=1.0, tpot_s=None, tenant="loud")
    window.add(1e6, error=False, ttft_s=0.1, tpot_s=None, tenant="late")
    outcomes, _ = window.recent(0.0)
    by = Counter(o[4] for o in outcomes)
    assert len(outcomes) == MAX_SAMPLES and by["quiet"] == 30 and by["late"] == 1
    assert min(o[0] for o in outcomes if o[4] == "loud") == 100.0 + MAX_SAMPLES * 2 - by["loud"]  # its newest kept
    for i in range(MAX_SAMPLES):
        window.add_divergence(float(i), 1.0, "loud")
    window.add_divergence(1e6, 0.0, "quiet")
    assert Counter(d[2] for d in window.recent(0.0)[1]) == {"loud": MAX_SAMPLES - 1, "quiet": 1}


def test_a_candidate_slower_for_everyone_still_rolls_back(service: RolloutService) -> None:
    start(service)
    for tenant in ("victim", "attacker", "third"):
        ordinary(service, tenant, 300, v2_ttft_s=3 * FAST + 0.06)
    assert run_guards(service) == "rolled_back"
    event = service.history("mid")[0]
    assert event.who == "guard" and "max_ttft_p95_ratio" in event.reason


def test_a_candidate_slower_for_everyone_rolls_back_whatever_one_tenant_steers(service: RolloutService) -> None:
    """The other way: a tenant sending only quick requests to the candidate cannot hide it behind them."""
    start(service)
    ordinary(service, "victim", 300, v2_ttft_s=SLOW)
    for conv in candidate_sessions(service, "attacker", 4) * 30:  # 120 quick ones on v2, beside the victim's ~30
        ask(service, "attacker", conv, FAST / 2)
    assert run_guards(service) == "rolled_back"


def test_a_candidate_failing_for_everyone_still_rolls_back(service: RolloutService) -> None:
    start(service)
    for tenant in ("victim", "attacker"):
        ordinary(service, tenant, 700, v2_errors=True)
    assert run_guards(service) == "rolled_back"
    assert "max_error_rate" in service.history("mid")[0].reason


def test_the_only_tenants_outcomes_judge_alone(service: RolloutService) -> None:
    """With no other tenant's traffic to say otherwise, one tenant's outcomes are all the evidence there is."""
    start(service)
    # 1,500 conversations: the canary's 10% is ~150 of them (the rollout's id, drawn at random, salts the buckets),
    # far above the guards' 50-request minimum; with 600 it fell short one run in 14 (binomial: 7.4%)
    seen = ordinary(service, "solo", 1500, v2_ttft_s=SLOW)
    assert seen["v2"] >= Guards().min_requests
    assert run_guards(service) == "rolled_back"


def test_a_named_tenant_is_never_left_out(service: RolloutService) -> None:
    """A canary of named tenants (the operator's choice) is judged on them, whatever other traffic there is."""
    service.start("mid", "v2", share=0.0, tenants=("vip",), who="k", reason="vip first",
                  guards=Guards(breach_for_s=5))
    ordinary(service, "other", 200)
    ordinary(service, "vip", 60, v2_ttft_s=SLOW)
    assert run_guards(service) == "rolled_back"


# ---- the pieces ----


def side(samples: list[tuple[float, str | None, int]], errors: int = 0) -> Side:
    """A window from (TTFT, tenant, prompt tokens) samples, the first `errors` of them failed."""
    return Side([(0.0, i < errors, t, 0.01, tenant, band(size)) for i, (t, tenant, size) in enumerate(samples)], [])


def test_latency_is_compared_within_prompt_sizes() -> None:
    guards = Guards(min_requests=20)
    short, long = 100, 8000  # a long prefill takes ten times as long, on either version
    base = side([(0.1, "a", short)] * 90 + [(1.0, "a", long)] * 10)
    lucky = side([(0.1, "a", short)] * 20 + [(1.0, "a", long)] * 20)  # the candidate got more long prompts
    assert judge(guards, lucky, base) == ([], [])
    assert p95([0.1] * 20 + [1.0] * 20) == 1.0  # what the plain ratio of the p95s would have compared with 0.1
    slower = side([(0.2, "a", short)] * 20 + [(2.0, "a", long)] * 20)  # twice as slow at every size
    breached, _ = judge(guards, slower, base)
    assert breached == ["max_ttft_p95_ratio: 2.00 > 1.5 (p95 1.1000s over 0.5500s in 2 prompt-size bands)"]


def test_bands() -> None:
    assert [band(n) for n in (None, 0, 511, 512, 1023, 1024, 4096, 100_000)] == [0, 0, 0, 1, 1, 2, 4, 8]


def test_a_p95_without_one_tenant_is_the_p95_of_the_others() -> None:
    rng = random.Random(7)
    for _ in range(300):
        samples = [(round(rng.random(), 2), rng.choice("abcd")) for _ in range(rng.randint(1, 60))]
        ranked = Ranked(list(samples))
        assert ranked.p95() == p95([v for v, _ in samples])
        for tenant in "abcde":
            assert ranked.p95(tenant) == p95([v for v, t in samples if t != tenant])
            assert ranked.size(tenant) == sum(t != tenant for _, t in samples)


def test_a_new_tenant_in_a_full_window_of_tenants_alike_is_kept() -> None:
    rings: Rings[int] = Rings(bound=3)
    for i, tenant in enumerate(("a", "b", "c", "d")):
        rings.append(tenant, i)
    assert sorted(rings.items()) == [1, 2, 3]  # the first tenant's gave way, not the newcomer's
