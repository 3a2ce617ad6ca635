"""The guards with a fake clock: what trips one, how long it must hold (hysteresis), and the rollback it makes.

A rollout's guards read the candidate's recent outcomes (and the baseline's, for the latency ratios); a breach rolls
the rollout back as `guard` only after it has held for `breach_for_s`, and never before `min_requests`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import InvalidRequest
from gateway.rollout.guards import MAX_SAMPLES, Guards, Window, guards_from, p95
from gateway.rollout.service import RolloutService
from gateway.rollout.state import SqliteRolloutStore
from tests.gateway.rollout.test_service import CATALOGUE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


GUARDS = Guards(max_error_rate=0.1, max_ttft_p95_ratio=2.0, max_tpot_p95_ratio=None, min_requests=10,
                window_s=60, breach_for_s=5)


@pytest.fixture
def service(tmp_path: Path) -> RolloutService:
    return RolloutService(CATALOGUE, SqliteRolloutStore(tmp_path / "state.db"), clock=Clock())


def traffic(s: RolloutService, version: str, n: int, *, errors: int = 0, ttft_s: float = 0.1) -> None:
    for i in range(n):
        s.observe("mid", version, error=i < errors, ttft_s=ttft_s, tpot_s=0.01)


def tick(s: RolloutService, seconds: float) -> str:
    """Let `seconds` pass, evaluate, and say the stage."""
    s.clock.now += seconds  # type: ignore[attr-defined]
    s.evaluate()
    return s.status()[0]["stage"]


def test_p95_is_the_nearest_rank() -> None:
    assert p95([float(v) for v in range(100, 0, -1)]) == 95.0
    assert p95([3.0]) == 3.0 and p95([]) is None
    assert p95([float(v) for v in range(1, 21)]) == 19.0  # ceil(0.95 * 20) = 19th smallest, not the maximum


def test_a_breach_rolls_back_only_once_it_has_held_and_the_trail_says_why(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="new weights", guards=GUARDS)
    traffic(service, "v1", 20)
    traffic(service, "v2", 20, errors=6)  # 30% errors
    assert tick(service, 1) == "canary"  # breached once: not yet
    assert service.status()[0]["guard"]["breached"][0].startswith("max_error_rate: 0.300 > 0.1")
    assert tick(service, 3) == "canary"  # breached for 3 s of the 5
    assert tick(service, 2) == "rolled_back"  # held for 5 s
    event = service.history("mid")[0]
    assert (event.action, event.who) == ("rollback", "guard")
    assert "max_error_rate" in event.reason and "breached for 5s" in event.reason
    assert event.metrics["v2"]["errors"] == 6 and event.metrics["v2"]["requests"] == 20
    assert event.metrics["v1"]["errors"] == 0


def test_one_healthy_evaluation_restarts_the_hysteresis(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="r", guards=GUARDS.model_copy(update={"window_s": 3}))
    traffic(service, "v2", 20, errors=5)
    assert tick(service, 1) == "canary"  # breach begins
    assert tick(service, 3) == "canary"  # the errors left the 3 s window: healthy, the clock stops
    traffic(service, "v2", 20, errors=5)
    assert tick(service, 1) == "canary"
    assert tick(service, 1.5) == "canary"  # 4.5 s after the first breach, but only 1.5 s into this one
    traffic(service, "v2", 20, errors=5)
    assert tick(service, 1) == "canary"  # 2.5 s into this breach
    traffic(service, "v2", 20, errors=5)
    assert tick(service, 2.5) == "rolled_back"


def test_too_few_requests_are_not_a_verdict(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="r", guards=GUARDS)
    traffic(service, "v2", 9, errors=9)  # every one failed, but 9 < min_requests
    for _ in range(10):
        assert tick(service, 1) == "canary"
    assert service.status()[0]["guard"]["breached"] == []


def test_a_healthy_candidate_is_not_rolled_back(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="r", guards=GUARDS)
    for _ in range(30):
        traffic(service, "v1", 10, errors=1, ttft_s=0.10)  # both versions fail at 10%: not above the bound
        traffic(service, "v2", 10, errors=1, ttft_s=0.15)  # p95 TTFT 1.5 x the baseline's: under 2
        assert tick(service, 1) == "canary"


def test_a_slow_candidate_trips_the_latency_ratio_and_a_slow_baseline_does_not(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="r", guards=GUARDS.model_copy(update={"breach_for_s": 0}))
    traffic(service, "v1", 20, ttft_s=0.5)
    traffic(service, "v2", 20, ttft_s=0.2)
    assert tick(service, 1) == "canary"
    traffic(service, "v2", 40, ttft_s=1.2)  # now its p95 is 1.2 s: 2.4 x the baseline's
    assert tick(service, 1) == "rolled_back"
    assert "max_ttft_p95_ratio: 2.40 > 2.0" in service.history("mid")[0].reason


def test_two_slow_samples_of_thirty_do_not_make_a_candidate_slow_and_five_do(service: RolloutService) -> None:
    """A stall shared by both versions lands on a few of a small canary's samples: its plain p95 (the 29th of 30) is
    then the stall, although the candidate is no slower than the baseline. The ratio reads the p95 the candidate
    has with 95% confidence (the 26th of 30), so it takes five slow samples of thirty to breach."""
    service.start("mid", "v2", share=0.1, who="k", reason="r", guards=GUARDS.model_copy(update={"breach_for_s": 0}))
    traffic(service, "v1", 262, ttft_s=0.03)
    traffic(service, "v1", 8, ttft_s=0.2)  # the stall's share of the baseline: 3% of its samples
    traffic(service, "v2", 28, ttft_s=0.03)
    traffic(service, "v2", 2, ttft_s=0.2)  # ... and 2 of the canary's 30
    assert tick(service, 1) == "canary"
    traffic(service, "v2", 3, ttft_s=0.2)  # 5 slow of 33: more than a shared stall explains
    assert tick(service, 1) == "rolled_back"
    assert "max_ttft_p95_ratio: 6.67 > 2.0" in service.history("mid")[0].reason


def test_a_window_keeps_a_bounded_number_of_outcomes() -> None:
    w = Window()
    for i in range(3 * MAX_SAMPLES):
        w.add(float(i), error=False, ttft_s=1.0, tpot_s=None)
    assert w.read(0.0).requests == MAX_SAMPLES


@pytest.mark.parametrize(("values", "param"), [
    ({"max_error_rate": 1.5}, "guards.max_error_rate"),
    ({"max_ttft_p95_ratio": 0.5}, "guards.max_ttft_p95_ratio"),
    ({"max_tpot_p95_ratio": float("inf")}, "guards.max_tpot_p95_ratio"),
    ({"max_divergence": -0.1}, "guards.max_divergence"),
    ({"min_requests": 0}, "guards.min_requests"),
    ({"window_s": 0.0}, "guards.window_s"),
    ({"breach_for_s": -1.0}, "guards.breach_for_s"),
    ({"max_errors": 0.1}, "guards.max_errors"),
])
def test_bad_thresholds_are_a_400_naming_the_field(values: dict[str, float], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        guards_from(values)
    assert exc.value.param == param and exc.value.message.startswith(param)


def test_milliseconds_of_jitter_on_a_fast_tier_do_not_trip_a_ratio(service: RolloutService) -> None:
    service.start("mid", "v2", share=0.5, who="k", reason="r", guards=GUARDS.model_copy(update={"breach_for_s": 0}))
    traffic(service, "v1", 20, ttft_s=0.002)
    traffic(service, "v2", 20, ttft_s=0.008)  # 4 x the baseline's p95, but 6 ms apart
    assert tick(service, 1) == "canary"
