"""The routing policy, one rule at a time: explicit tiers, plan restrictions, `auto` by predicted quality,
budget thresholds, load and health skips, and dearer tiers only where the plan allows them."""

from __future__ import annotations

import pytest

from gateway.config_files import load_yaml
from gateway.settings import REPO_ROOT
from quotas.plans import PlanBook, RoutingPlan
from tiers.catalogue import TierCatalogue
from tiers.errors import NoTierAvailable, TierNotAllowed, TierOverloaded, UnknownModel
from tiers.routing import Prediction, Route, RouteRules, TierConditions, choose_tier

CAT = load_yaml(REPO_ROOT / "tiers" / "tiers.yaml", TierCatalogue)
ALL = ["small", "mid", "full"]
EASY = Prediction({"small": 0.9, "mid": 0.95, "full": 1.0}, "v1")
MEDIUM = Prediction({"small": 0.6, "mid": 0.85, "full": 1.0}, "v1")
HARD = Prediction({"small": 0.3, "mid": 0.5, "full": 1.0}, "v1")


def full_route(requested: str = "auto", *, allowed: list[str] = ALL, default: str = "mid", upgrade: bool = False,
               down: dict[str, str] | None = None, waits: dict[str, float] | None = None,
               max_wait: float | None = None, shed: bool = False, dearer_on_load: bool = False, floor: float = 0.8,
               prediction: Prediction | None = None, groups: dict[str, str] | None = None, policy: str = "predict",
               cascade: bool = False) -> Route:
    rules = RouteRules(allowed=allowed, default=default, allow_upgrade=upgrade, shed_to_cheaper=shed,
                       dearer_on_load=dearer_on_load, max_wait_s=max_wait, quality_floor=floor,
                       floor_reason=f"floor {floor:g}", policy=policy, cascade=cascade)
    return choose_tier(requested, catalogue=CAT, rules=rules, prediction=prediction,
                       conditions=TierConditions(down or {}, waits or {}, groups or {}))


def route(requested: str = "auto", **kwargs: object) -> tuple[str, str]:
    r = full_route(requested, **kwargs)  # type: ignore[arg-type]
    return r.tier.name, r.reason


def test_explicit_tier_is_honoured_only_where_the_plan_allows_it() -> None:
    assert route("full", prediction=EASY) == ("full", "requested")  # no second-guessing an explicit choice
    with pytest.raises(TierNotAllowed):
        route("full", allowed=["small", "mid"])
    with pytest.raises(UnknownModel):
        route("gpt-4o")


def test_auto_without_a_difficulty_model_is_the_plans_default() -> None:
    name, reason = route(default="mid")
    assert name == "mid" and reason == "auto: no difficulty model yet; the plan's default tier"


def test_auto_takes_the_cheapest_tier_that_reaches_the_floor() -> None:
    assert route(prediction=EASY)[0] == "small"
    name, reason = route(prediction=MEDIUM)
    assert name == "mid"
    assert reason == "auto: mid predicted fidelity 0.85 >= floor 0.8 (difficulty model v1)"
    assert route(prediction=HARD)[0] == "full"
    assert route(prediction=MEDIUM, floor=0.9)[0] == "full"
    assert route(prediction=MEDIUM, floor=0.5)[0] == "small"


def test_auto_never_leaves_the_plans_tiers() -> None:
    # full is what this request needs, but the plan stops at mid: the best it allows, said so
    name, reason = route(prediction=HARD, allowed=["small", "mid"], default="small")
    assert name == "mid" and "no tier reaches floor 0.8" in reason and "mid predicts the most (0.50" in reason


def test_budget_thresholds_relax_the_floor_as_the_budget_runs_out() -> None:
    plan = RoutingPlan(quality_floor=0.8, budget_thresholds=[{"below_fraction": 0.2, "quality_floor": 0.5},
                                                             {"below_fraction": 0.5, "quality_floor": 0.7}])
    assert plan.floor_for(None) == (0.8, "floor 0.8")
    assert plan.floor_for(0.9)[0] == 0.8
    assert plan.floor_for(0.4) == (0.7, "floor 0.7 (budget 40% left < 50%)")
    assert plan.floor_for(0.1)[0] == 0.5
    assert plan.floor_for(0.0)[0] == 0.5
    medium = Prediction({"small": 0.55, "mid": 0.75, "full": 1.0}, "v1")
    assert [route(prediction=medium, floor=plan.floor_for(left)[0])[0] for left in (0.9, 0.4, 0.1)] == [
        "full", "mid", "small"]


@pytest.mark.parametrize("thresholds, error", [
    ([{"below_fraction": 0.5, "quality_floor": 0.9}], "may only relax"),
    ([{"below_fraction": 0.5, "quality_floor": 0.5}, {"below_fraction": 0.2, "quality_floor": 0.6}], "may only relax"),
    ([{"below_fraction": 0.5, "quality_floor": 0.5}, {"below_fraction": 0.5, "quality_floor": 0.4}], "repeat"),
    ([{"below_fraction": 1.5, "quality_floor": 0.5}], "less than 1"),
])
def test_bad_budget_thresholds_are_refused(thresholds: list[dict[str, float]], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RoutingPlan(quality_floor=0.8, budget_thresholds=thresholds)


def test_shipped_plans_have_routing_settings() -> None:
    book = load_yaml(REPO_ROOT / "quotas" / "plans.yaml", PlanBook, context={"tiers": set(CAT.tiers)})
    assert book.plans["standard"].routing.budget_thresholds
    assert book.plans["enterprise"].routing.quality_floor > book.plans["free"].routing.quality_floor


def test_unavailable_tier_falls_back_to_the_closest_cheaper_one() -> None:
    name, reason = route("full", down={"full": "engine crashed"})
    assert name == "mid" and reason == "full unavailable (engine crashed); fell back to mid"
    assert route("full", down={"full": "x", "mid": "y"})[0] == "small"
    name, reason = route(prediction=HARD, down={"full": "circuit breaker open on every healthy replica"})
    assert name == "mid" and reason.startswith("auto: full predicted") and "circuit breaker open" in reason


def test_dearer_fallback_only_where_the_plan_allows_it() -> None:
    with pytest.raises(NoTierAvailable) as exc:
        route("small", down={"small": "not built"})
    assert "not built" in str(exc.value)
    assert route("small", upgrade=True, down={"small": "not built"})[0] == "mid"
    assert route("small", upgrade=True, allowed=["small", "full"], down={"small": "x"})[0] == "full"
    with pytest.raises(NoTierAvailable):
        route(prediction=EASY, down={"small": "not built"})


def test_an_overloaded_tier_is_refused_unless_the_plan_sheds() -> None:
    backed_up = {"full": 120.0}
    with pytest.raises(TierOverloaded) as exc:
        route(prediction=HARD, waits=backed_up, max_wait=5)
    assert exc.value.wait_s == 120.0 and "predicted wait 120.0s exceeds your plan's 5" in str(exc.value)
    name, reason = route(prediction=HARD, waits=backed_up, max_wait=5, shed=True)
    assert name == "mid" and reason.endswith("full predicted wait 120.0s > 5s; shed to mid")
    # shedding skips a cheaper tier that is itself backed up or down
    assert route(prediction=HARD, waits=backed_up | {"mid": 9.0}, max_wait=5, shed=True)[0] == "small"
    assert route(prediction=HARD, waits=backed_up, down={"mid": "x"}, max_wait=5, shed=True)[0] == "small"
    assert route(prediction=HARD, waits=backed_up)[0] == "full"  # no limit in the plan: no load skip


def test_an_overloaded_tier_goes_dearer_only_where_the_plan_allows_it() -> None:
    with pytest.raises(TierOverloaded):
        route(prediction=EASY, waits={"small": 60.0}, max_wait=5, shed=True, upgrade=True)
    name, reason = route(prediction=EASY, waits={"small": 60.0}, max_wait=5, dearer_on_load=True)
    assert name == "mid" and "shed to mid" in reason


def test_load_is_shed_only_to_a_tier_with_hardware_of_its_own() -> None:
    """mid runs on full's cores: moving full's overload there adds no capacity, even with mid's queue empty."""
    backed_up = {"full": 120.0}
    shared = {"full": "cpu:full+mid", "mid": "cpu:full+mid", "small": "cpu:small"}
    name, reason = route("full", waits=backed_up, max_wait=5, shed=True, groups=shared)
    assert name == "small" and reason == "full predicted wait 120.0s > 5s; shed to small"
    everything_shared = dict.fromkeys(ALL, "cpu:all")
    with pytest.raises(TierOverloaded) as exc:
        route("full", waits=backed_up, max_wait=5, shed=True, groups=everything_shared)
    assert (exc.value.tier, exc.value.wait_s) == ("full", 120.0)  # a 503 with full's wait, not a slow answer
    assert "mid: shares full's hardware (cpu:all): no capacity of its own" in str(exc.value)
    # disjoint cores: shedding to the closest cheaper tier, as before
    apart = {"full": "cpu:full", "mid": "cpu:mid", "small": "cpu:small"}
    assert route("full", waits=backed_up, max_wait=5, shed=True, groups=apart)[0] == "mid"
    # the same rule for a plan that moves load to a dearer tier
    with pytest.raises(TierOverloaded):
        route(prediction=EASY, waits={"small": 60.0}, max_wait=5, dearer_on_load=True, groups=everything_shared)


def test_an_unavailable_tier_falls_back_within_its_hardware_group() -> None:
    """A tier that is down frees its cores, so the tier beside it on them has capacity."""
    shared = dict.fromkeys(ALL, "cpu:all")
    name, reason = route("full", down={"full": "engine crashed"}, groups=shared)
    assert name == "mid" and reason == "full unavailable (engine crashed); fell back to mid"


def test_overloaded_everywhere_reports_the_shortest_wait() -> None:
    with pytest.raises(TierOverloaded) as exc:
        route("full", waits={"full": 100.0, "mid": 30.0, "small": 60.0}, max_wait=5, shed=True)
    assert (exc.value.tier, exc.value.wait_s) == ("mid", 30.0)


def test_predictions_for_tiers_the_plan_lacks_or_the_model_lacks() -> None:
    only_remote = Prediction({"remote-large": 0.99}, "v2")
    name, reason = route(prediction=only_remote)
    assert name == "mid" and "predicts none of the plan's tiers" in reason
    partial = Prediction({"small": 0.2}, "v2")  # a tier the model does not know is not guessed at
    assert route(prediction=partial, floor=0.1)[0] == "small"


def test_tiers_are_ordered_by_price() -> None:
    assert [t.name for t in CAT.by_price()] == ["small", "mid", "full"]


# ---- a router that cannot predict, and the cascade policy ----

BLIND_SMALL = Prediction({"small": 0.6, "mid": 0.85, "full": 1.0}, "v3",
                         {"small": "CV RMSE 0.1247 vs 0.1248 predicting the mean"})


def test_a_tier_the_model_cannot_predict_falls_back_to_the_cascade_and_says_so() -> None:
    r = full_route(prediction=BLIND_SMALL)
    assert (r.tier.name, r.cascade, r.floor) == ("small", True, 0.8)
    assert r.reason == ("auto: difficulty model v3 cannot predict small (CV RMSE 0.1247 vs 0.1248 predicting the "
                        "mean): cascade policy, small first, kept if its confidence reaches floor 0.8")
    # a plan without small: mid's prediction is trusted as before, and only checked where the plan cascades
    r = full_route(prediction=BLIND_SMALL, allowed=["mid", "full"])
    assert (r.tier.name, r.cascade) == ("mid", False) and "mid predicted fidelity 0.85" in r.reason
    assert full_route(prediction=BLIND_SMALL, allowed=["mid", "full"], cascade=True).cascade
    # an informative model: no cascade unless the plan has one
    assert not full_route(prediction=EASY).cascade and full_route(prediction=EASY, cascade=True).cascade


def test_the_cascade_policy_starts_on_the_cheapest_allowed_tier() -> None:
    r = full_route(policy="cascade", prediction=HARD, floor=0.9)
    assert (r.tier.name, r.cascade, r.floor) == ("small", True, 0.9)
    assert r.reason == "auto: cascade policy: small first, kept if its confidence reaches floor 0.9"
    assert full_route(policy="cascade", allowed=["mid", "full"]).tier.name == "mid"
    # small down: the plan's fallback rules apply, and mid's answer is the one checked
    r = full_route(policy="cascade", down={"small": "not built"}, upgrade=True)
    assert (r.tier.name, r.cascade) == ("mid", True)
    assert r.reason.endswith("small unavailable (not built); fell back to mid")


def test_explicit_tiers_carry_no_floor_and_never_cascade() -> None:
    r = full_route("small", policy="cascade", cascade=True)
    assert (r.tier.name, r.cascade, r.floor, r.auto) == ("small", False, None, False)


def test_a_plan_with_the_cascade_policy_cascades() -> None:
    assert RoutingPlan(policy="cascade").cascade and not RoutingPlan().cascade
    with pytest.raises(ValueError):
        RoutingPlan(policy="random")  # type: ignore[arg-type]
