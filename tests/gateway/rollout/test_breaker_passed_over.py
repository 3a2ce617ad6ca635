"""A request passed over because the candidate's circuit breakers are open is no error of the candidate's nor of
the tenant whose request it was: one tenant opening a quiet canary's breaker does not roll it back through the
others' traffic, while a candidate that fails everyone still does."""

from __future__ import annotations

from pathlib import Path

from gateway.rollout.service import RolloutService
from gateway.rollout.state import SqliteRolloutStore
from tiers.breaker import CircuitBreaker
from tiers.catalogue import TierCatalogue, TierSpec

TIER = {"backend": "openai", "model": "m", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}
MID = TIER | {"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]}]}
CATALOGUE = TierCatalogue.model_validate({"tiers": {"mid": MID}})
SPEC = CATALOGUE.tiers["mid"]


class Canary:
    """A running 50% canary whose candidate has one breaker; requests go as `choose` sends them."""

    def __init__(self, tmp_path: Path) -> None:
        self.now = 1000.0
        self.breaker = CircuitBreaker(clock=lambda: self.now)
        self.s = RolloutService(CATALOGUE, SqliteRolloutStore(tmp_path / "s.db"), clock=lambda: self.now)
        self.s.start("mid", "v2", share=0.5, who="op", reason="canary")

    def down(self, spec: TierSpec) -> str | None:
        return None if spec.version_name != "v2" or self.breaker.can_take() else f"circuit breaker {self.breaker.state}"

    def request(self, tenant: str, conversation: str, *, candidate_fails: bool) -> str:
        spec, _ = self.s.choose(SPEC, tenant, lambda: conversation, self.down)
        assert spec.version_name is not None
        failed = candidate_fails and spec.version_name == "v2"
        if spec.version_name == "v2":
            self.breaker.begin()
            (self.breaker.failure("500 from engine", tenant) if failed else self.breaker.success(tenant))
        self.s.observe("mid", spec.version_name, error=failed, tenant=tenant, prompt_tokens=10, ttft_s=0.1)
        return spec.version_name

    def judged(self) -> str:
        self.now += 1
        self.s.evaluate()
        self.now += 31  # past breach_for_s
        self.s.evaluate()
        return self.s.status()[0]["stage"]


def test_one_tenant_opening_the_breaker_does_not_roll_back(tmp_path: Path) -> None:
    c = Canary(tmp_path)
    answered = 0
    for i in range(40):  # bob's few answers on the candidate: under the breaker's minimum to hold evil's failures
        answered += c.request("bob", f"bob-{i}", candidate_fails=False) == "v2"
        if answered == 3:
            break
    for i in range(400):  # evil finds conversations on the candidate and sends it what it chokes on
        c.request("evil", f"evil-{i}", candidate_fails=True)
    assert c.breaker.state == "open"
    for i in range(120):  # the others' traffic: what is due to the candidate is passed over for the baseline
        c.request(f"t{i % 6}", f"t{i % 6}-{i}", candidate_fails=False)
    v2 = c.s.status()[0]["versions"]["v2"]
    assert v2["errors"] == 5  # evil's failures that opened the breaker, nothing for the requests passed over
    assert c.judged() == "canary"
    guard = c.s.status()[0]["guard"]
    assert guard["breached"] == [] and "held by tenant 'evil' alone" in guard["held"][0]
    assert guard["versions"]["v2"]["passed_over"] > 50


def test_a_candidate_failing_everyone_still_rolls_back(tmp_path: Path) -> None:
    c = Canary(tmp_path)
    for i in range(150):
        c.request(f"t{i % 6}", f"t{i % 6}-{i}", candidate_fails=True)
    assert c.breaker.state == "open"
    assert c.judged() == "rolled_back"
    event = c.s.history("mid", 1)[0]
    assert event.who == "guard" and "max_error_rate" in event.reason


def test_a_candidate_down_for_another_reason_is_still_its_error(tmp_path: Path) -> None:
    c = Canary(tmp_path)
    def unhealthy(spec: TierSpec) -> str | None:
        return "unhealthy" if spec.version_name == "v2" else None

    for i in range(60):
        spec, _ = c.s.choose(SPEC, f"t{i % 6}", lambda i=i: f"c{i}", unhealthy)
        assert spec.version_name == "v1"
    assert c.s.status()[0]["versions"]["v2"]["errors"] > 0
