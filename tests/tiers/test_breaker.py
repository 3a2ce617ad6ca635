"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

from tiers.breaker import BreakerConfig, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def breaker(**config: float) -> tuple[CircuitBreaker, Clock, list[tuple[str, str]]]:
    clock, changes = Clock(), []
    b = CircuitBreaker(BreakerConfig(**config), clock=clock,  # type: ignore[arg-type]
                       on_change=lambda old, new, why: changes.append((old, new)))
    return b, clock, changes


def test_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    b, _, changes = breaker(failures_to_open=3)
    b.failure("x")
    b.failure("x")
    b.success()
    b.failure("x")
    b.failure("x")
    assert b.state == "closed" and b.can_take()
    b.failure("refused")
    assert b.state == "open" and not b.can_take()
    assert changes == [("closed", "open")]


def test_opens_on_a_failure_rate_without_consecutive_failures() -> None:
    b, _, _ = breaker(failures_to_open=5, failure_rate_to_open=0.5, min_requests=10)
    for _ in range(4):
        b.success()
        b.failure("x")
    assert b.state == "closed"  # 8 outcomes: too few to judge a rate
    b.success()
    b.failure("x")
    assert b.state == "open"


def test_old_outcomes_leave_the_window() -> None:
    b, clock, _ = breaker(failures_to_open=100, failure_rate_to_open=0.5, min_requests=4, window_s=30)
    for _ in range(3):
        b.failure("x")
    clock.t += 31
    b.success()
    b.success()
    b.success()
    b.failure("x")
    assert b.state == "closed"  # 1 of 4 in the window


def test_half_open_lets_one_probe_through_and_closes_on_its_success() -> None:
    b, clock, changes = breaker(failures_to_open=1, cooldown_s=10)
    b.failure("x")
    clock.t += 9
    assert not b.can_take()
    clock.t += 1
    assert b.state == "half_open" and b.can_take()
    b.begin()  # the probe goes out
    assert not b.can_take()  # and nothing else until it is back
    b.success()
    assert b.state == "closed" and b.can_take()
    assert changes == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_a_failed_probe_opens_it_for_another_cool_down() -> None:
    b, clock, changes = breaker(failures_to_open=1, cooldown_s=10)
    b.failure("x")
    clock.t += 10
    b.begin()
    b.failure("still down")
    assert b.state == "open"
    clock.t += 5
    assert not b.can_take()
    clock.t += 5
    assert b.can_take()
    assert changes[-2:] == [("half_open", "open"), ("open", "half_open")]


def test_an_abandoned_probe_frees_the_slot() -> None:
    b, clock, _ = breaker(failures_to_open=1, cooldown_s=1)
    b.failure("x")
    clock.t += 1
    b.begin()
    b.abandon()  # the client went away: no verdict
    assert b.state == "half_open" and b.can_take()


def test_each_state_change_is_reported_once() -> None:
    b, _, changes = breaker(failures_to_open=2)
    for _ in range(10):
        b.failure("x")
    assert changes == [("closed", "open")]


def test_one_tenants_run_of_failures_is_its_own_while_the_others_are_served() -> None:
    """Five failures at once of one tenant's requests (an input the replica chokes on) do not take the replica from
    the others, whose requests it serves; a failure of another tenant's joins the run, and it opens."""
    b, _, changes = breaker(failures_to_open=5, min_requests=10)
    for _ in range(5):
        b.success("victim")
    for _ in range(8):
        b.failure("answered 500", "attacker")
    assert b.state == "closed" and b.can_take()
    b.failure("answered 500", "victim")
    assert b.state == "open" and changes == [("closed", "open")]


def test_one_tenants_failure_rate_is_its_own_and_a_replica_failing_everyone_opens() -> None:
    b, _, _ = breaker(failures_to_open=5, failure_rate_to_open=0.5, min_requests=10)
    for _ in range(5):
        b.success("victim")
    for _ in range(20):  # interleaved: no consecutive run, and 40 of the window's 65 outcomes failed
        b.success("victim")
        b.failure("answered 500", "attacker")
        b.failure("answered 500", "attacker")
    assert b.state == "closed"
    b.failure("timed out", "victim")  # the replica breaks for everyone: the attacker's last two and these
    b.failure("timed out", "attacker")
    assert b.state == "closed"  # four in a row
    b.failure("timed out", "victim")
    assert b.state == "open"


def test_a_lone_tenant_and_the_gateways_own_calls_are_judged_on_what_they_have() -> None:
    lone, _, _ = breaker(failures_to_open=3)
    for _ in range(3):
        lone.failure("answered 500", "only")
    assert lone.state == "open"
    own, _, _ = breaker(failures_to_open=3)
    for _ in range(10):
        own.success("victim")
    for _ in range(3):
        own.failure("unreachable")  # no tenant: the gateway's own probe or shadow call
    assert own.state == "open"


def test_the_window_forgets_a_tenant_whose_outcomes_aged_out() -> None:
    b, clock, _ = breaker(failures_to_open=3, window_s=30)
    for _ in range(10):
        b.success("victim")
    clock.t += 31  # the victim's successes leave the window: nothing says the replica works for the others
    for _ in range(3):
        b.failure("answered 500", "attacker")
    assert b.state == "open"


def two_served_two_failing(b: CircuitBreaker, failures: int) -> None:
    """Five successes each of tenants v1 and v2, then `failures` each of a1 and a2, taking turns."""
    for _ in range(5):
        b.success("v1")
        b.success("v2")
    for _ in range(failures):
        b.failure("answered 500", "a1")
        b.failure("answered 500", "a2")


def test_two_tenants_failing_together_open_it_no_more_than_one_while_the_others_are_served() -> None:
    """Two attackers taking turns make one run of failures of two tenants, and each leaves the other's failures in
    the rate; the replica still serves the two other tenants. A failure of theirs joins the run, and it opens."""
    b, _, changes = breaker(failures_to_open=5, failure_rate_to_open=0.5, min_requests=10)
    two_served_two_failing(b, 8)
    assert b.state == "closed" and b.consecutive_failures == 16
    b.failure("timed out", "v1")
    assert b.state == "open" and changes == [("closed", "open")]


def test_two_tenants_failure_rate_is_their_own_and_a_replica_failing_everyone_opens() -> None:
    b, _, _ = breaker(failures_to_open=50, failure_rate_to_open=0.5, min_requests=10)  # the rate alone decides
    two_served_two_failing(b, 12)
    assert b.state == "closed"  # 24 of 34 failed; without a1's, a2's 12 of the 22 left
    everyone, _, _ = breaker(failures_to_open=50, failure_rate_to_open=0.5, min_requests=10)
    for _ in range(8):  # the replica fails everyone's requests alike: nobody's failures are their own
        for tenant in ("v1", "v2", "a1", "a2"):
            everyone.success(tenant)
            everyone.failure("timed out", tenant)
    assert everyone.state == "open"
