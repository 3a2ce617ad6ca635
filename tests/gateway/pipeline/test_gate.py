"""The gate: a scope's requests in progress against its concurrency limit, and a remembered rate refusal
that lasts exactly until the window frees a place; both refuse only what the exact check would."""

from __future__ import annotations

import pytest

from gateway.errors import RateLimited, TiergateError
from gateway.pipeline.gate import RATE_RECHECK_S, TenantGate, scopes_of
from quotas.plans import Limits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_concurrency_counts_until_each_request_leaves() -> None:
    gate = TenantGate()
    scopes = scopes_of("acme", "k1", Limits(max_concurrent=2), None)
    first, second = gate.enter(scopes), gate.enter(scopes)
    with pytest.raises(RateLimited) as err:
        gate.enter(scopes)
    assert err.value.code == "rate_limit_concurrency" and err.value.retry_after == 1
    first.leave()
    first.leave()  # leaving twice frees one place, once
    third = gate.enter(scopes)
    with pytest.raises(RateLimited):
        gate.enter(scopes)
    second.leave()
    third.leave()
    assert gate.in_flight("acme") == 0


def test_a_key_with_its_own_limit_is_held_to_it_and_its_tenant_is_not() -> None:
    gate = TenantGate()
    tight = scopes_of("acme", "k1", Limits(max_concurrent=10), Limits(max_concurrent=1))
    other = scopes_of("acme", "k2", Limits(max_concurrent=10), None)
    gate.enter(tight)
    with pytest.raises(RateLimited) as err:
        gate.enter(tight)
    assert "your key" in err.value.message
    gate.enter(other)  # another key of the tenant still gets in
    assert gate.in_flight("acme") == 2 and gate.in_flight("acme/k:k1") == 1


def test_a_rate_refusal_is_remembered_for_a_moment_then_the_exact_check_is_asked_again() -> None:
    clock = Clock()
    gate = TenantGate(clock)
    scopes = scopes_of("acme", "k1", Limits(rpm=5), None)
    gate.rate_refused("acme", 12.5)
    with pytest.raises(RateLimited) as err:
        gate.enter(scopes)
    assert err.value.code == "rate_limit_rpm" and err.value.retry_after == 13  # the exact check's time
    clock.now += RATE_RECHECK_S - 0.1
    with pytest.raises(RateLimited) as err:
        gate.enter(scopes)
    assert err.value.retry_after == 12
    clock.now += 0.2
    gate.enter(scopes).leave()  # an undone reservation may have freed a place: the exact check decides
    assert gate.in_flight("acme") == 0
    gate.rate_refused("acme", 0.4)  # a place frees sooner than the recheck: asked as soon as it does
    clock.now += 0.5
    gate.enter(scopes).leave()


@pytest.mark.parametrize(("reason", "code"), [("tpm", "rate_limit_tpm"), ("budget_day", "insufficient_quota"),
                                              ("budget_month", "insufficient_quota")])
def test_a_token_or_budget_refusal_is_remembered_until_a_settlement_or_the_recheck(reason: str, code: str) -> None:
    clock = Clock()
    gate = TenantGate(clock)
    scopes = scopes_of("acme", "k1", Limits(tpm=1000, budget_day_usd=1), None)
    gate.rate_refused("acme", 3600.0, reason)
    with pytest.raises(TiergateError) as err:
        gate.enter(scopes)
    assert err.value.code == code and err.value.retry_after == 3600
    clock.now += RATE_RECHECK_S + 0.01  # asked again after a second, though the retry time is an hour off
    gate.enter(scopes).leave()
    gate.rate_refused("acme", 3600.0, reason)
    gate.settled("other", ("t",))  # another tenant's settlement frees nothing of acme's
    with pytest.raises(TiergateError):
        gate.enter(scopes)
    gate.settled("acme", ("t",))  # what a reservation held beyond its use is free: the exact check decides
    gate.enter(scopes).leave()


@pytest.mark.parametrize("reason", ["rpm", "tpm", "budget_day"])
def test_a_remembered_refusal_is_the_exact_checks_429_headers_and_all(reason: str) -> None:
    """A client reads the same message, code, Retry-After and x-ratelimit-* headers whichever of the two refused."""
    from decimal import Decimal

    from gateway.pipeline.reserve import refusal
    from quotas.limits import Decision
    from quotas.plans import Plan

    clock = Clock()
    gate = TenantGate(clock)
    limits = Limits(rpm=5, tpm=1000, budget_day_usd=Decimal(1))
    plan = Plan(name="p", limits=limits, allowed_tiers=["mid"], default_tier="mid")
    exact = refusal(plan, Decision(admitted=False, reason=reason, scope="t", retry_after_s=12.5))
    gate.rate_refused("acme", 12.5, reason)
    with pytest.raises(TiergateError) as err:
        gate.enter(scopes_of("acme", "k1", limits, None))
    remembered = err.value
    assert (remembered.message, remembered.code, remembered.retry_after) == (exact.message, exact.code, 13)
    assert remembered.headers == exact.headers
    if reason != "budget_day":
        assert remembered.headers[f"x-ratelimit-remaining-{'requests' if reason == 'rpm' else 'tokens'}"] == "0"


def test_a_settlement_does_not_free_a_request_rate() -> None:
    gate = TenantGate(Clock())
    gate.rate_refused("acme/k:k1", 30.0)
    gate.settled("acme", ("t", "k:k1"))
    with pytest.raises(RateLimited) as err:
        gate.enter(scopes_of("acme", "k1", Limits(), Limits(rpm=1)))
    assert err.value.code == "rate_limit_rpm" and "your key" in err.value.message


def test_unlimited_scopes_pass() -> None:
    gate = TenantGate()
    scopes = scopes_of("acme", "k1", Limits(), None)
    passes = [gate.enter(scopes) for _ in range(1000)]
    assert gate.in_flight("acme") == 1000
    for p in passes:
        p.leave()


def test_a_tenant_whose_bodies_are_refused_by_the_megabyte_waits_for_its_bucket() -> None:
    clock = Clock()
    gate = TenantGate(clock, refused_bytes_per_s=2, refused_bytes_burst=10)
    acme, globex = scopes_of("acme", "k1", Limits(), None), scopes_of("globex", "k2", Limits(), None)
    gate.body_refused("acme", 6)
    gate.enter(acme).leave()  # 4 left
    gate.body_refused("acme", 9)  # 5 short
    with pytest.raises(RateLimited) as err:
        gate.enter(acme)
    assert err.value.code == "rate_limit_invalid_requests" and err.value.retry_after == 3
    gate.enter(globex).leave()  # another tenant's bucket is its own
    clock.now += 2.0
    with pytest.raises(RateLimited):
        gate.enter(acme)  # 1 short still
    clock.now += 0.5
    gate.enter(acme).leave()  # refilled to empty: admitted
    clock.now += 60
    assert gate._bucket("acme", clock.now) == 10 and "acme" not in gate._refused  # full again: forgotten
