"""Which tenants a shared signal leaves out (tiers/tenant_counts.py): the one that dominates it, or a few standing
out together, while the rest have enough outcomes of their own and fare well; never a fault that hits everyone."""

from __future__ import annotations

from tiers.tenant_counts import CONTEST_MAX, OUTCOMES, TenantCounts, left_out


def counts(**tenants: tuple[int, int]) -> TenantCounts:
    """tenant=(good outcomes, bad outcomes); `_` stands for tenant "" (the gateway's own calls)."""
    out = TenantCounts()
    for name, (good, bad) in tenants.items():
        for _ in range(good):
            out.add("" if name == "_" else name)
        for _ in range(bad):
            out.add("" if name == "_" else name, True)
    return out


def test_counts_follow_outcomes_in_and_out() -> None:
    c = counts(a=(3, 2), b=(1, 0))
    assert (c.n, c.bad, len(c), set(c)) == (6, 2, 2, {"a", "b"})
    assert c.without({"a"}) == (1, 0) and c.rate_without(()) == 2 / 6
    c.remove("b")
    c.remove("a", True)
    assert (c.n, c.bad, set(c)) == (4, 1, {"a"})  # a tenant with nothing left in the window is gone
    assert c.rate_without({"a"}) == 0.0


def test_one_dominant_tenant_is_left_out_while_the_others_have_enough() -> None:
    assert left_out(counts(victim=(9, 0), attacker=(0, 30)), 10) == frozenset()  # nine of the others: too few
    assert left_out(counts(victim=(10, 0), attacker=(0, 30)), 10) == {"attacker"}
    assert left_out(counts(_=(0, 40), victim=(10, 0), attacker=(0, 30)), 10) == frozenset()  # "" is never left out
    assert left_out(counts(only=(0, 30), _=(10, 0)), 10) == {"only"}  # the gateway's own outcomes are others too
    assert left_out(counts(victim=(0, 10), busy=(100, 0)), 10, by=OUTCOMES) == {"busy"}


def test_two_tenants_acting_together_are_both_left_out_while_the_rest_are_fine() -> None:
    two = counts(v1=(10, 0), v2=(10, 0), a1=(0, 12), a2=(0, 12))
    assert left_out(two, 10) == {"a1", "a2"}
    assert two.rate_without(left_out(two, 10)) == 0.0
    assert left_out(counts(v1=(10, 0), v2=(10, 1), a1=(0, 12), a2=(1, 12)), 10) == {"a1", "a2"}  # not spotless


def test_a_fault_that_hits_everyone_leaves_out_no_more_than_before() -> None:
    """Everyone failing alike: no tenant stands out of the rest, so only the dominant one is left out, as before,
    and the rate stays what the others see."""
    everyone = counts(v1=(5, 5), v2=(5, 5), a1=(0, 12), a2=(0, 12))
    assert left_out(everyone, 10) == {"a1"}  # a2's 100% is not twice the others' 10 of 20
    assert everyone.rate_without(left_out(everyone, 10)) == 22 / 32
    alike = counts(**{f"t{i}": (6, 4 + i % 2) for i in range(8)})  # eight tenants failing 40-45% of requests
    assert len(left_out(alike, 10)) == 1


def test_members_need_outcomes_of_their_own_and_the_rest_keeps_contest_min() -> None:
    assert left_out(counts(v1=(10, 0), v2=(10, 0), a1=(0, 12), a2=(0, 9)), 10) == {"a1"}  # a2: nine, too few alone
    assert left_out(counts(v1=(4, 0), v2=(4, 0), a1=(0, 12), a2=(0, 12)), 10) == {"a1"}  # the rest: eight


def test_a_coalition_is_at_most_half_the_tenants_and_at_most_contest_max() -> None:
    assert left_out(counts(v=(20, 0), a1=(0, 12), a2=(0, 12)), 10) == {"a1"}  # two of three are a majority
    many = {f"a{i}": (0, 20 - i) for i in range(CONTEST_MAX + 1)} | {f"v{i}": (10, 0) for i in range(CONTEST_MAX + 1)}
    assert left_out(counts(**many), 10) == {f"a{i}" for i in range(CONTEST_MAX)}  # the worst CONTEST_MAX of them


def test_a_stand_out_test_of_the_callers_own() -> None:
    """The ladder's waits stand out by their p95, not a rate: the caller says who stands out of whom."""
    waits = counts(v1=(10, 0), v2=(10, 0), f1=(200, 0), f2=(150, 0))
    asked: list[tuple[str, frozenset[str]]] = []

    def stands_out(tenant: str, left: frozenset[str]) -> bool:
        asked.append((tenant, left))
        return True

    assert left_out(waits, 10, by=OUTCOMES, stands_out=stands_out) == {"f1", "f2"}
    assert asked == [("f2", frozenset({"f1", "f2"}))]
    assert left_out(waits, 10, by=OUTCOMES, stands_out=lambda t, left: False) == {"f1"}
