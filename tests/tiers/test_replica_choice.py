"""Replica choice: affinity first, then least predicted wait; unhealthy replicas and open breakers skipped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config_files import load_yaml
from gateway.settings import REPO_ROOT
from tiers.breaker import BreakerConfig, CircuitBreaker
from tiers.catalogue import TierCatalogue
from tiers.replica import Replica
from tiers.replica_choice import AffinityMap, affinity_key, choose_replica

SYSTEM = {"role": "system", "content": "be brief"}
TURN1 = [SYSTEM, {"role": "user", "content": "what is a KV cache?"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "a cache of keys and values"}, {"role": "user", "content": "why?"}]


def ready(index: int, *, inflight: int = 0, latency: float | None = None) -> Replica:
    r = Replica("mid", index, url=f"http://r{index}")
    r.mark("ready", "")
    r.inflight = inflight
    r.latency_ewma_s = latency
    return r


def test_follow_ups_share_their_conversations_key_and_others_do_not() -> None:
    assert affinity_key("acme", TURN1) == affinity_key("acme", TURN2)
    assert affinity_key("acme", TURN1) != affinity_key("other", TURN1)  # never across tenants
    other = [SYSTEM, {"role": "user", "content": "something else"}]
    assert affinity_key("acme", TURN1) != affinity_key("acme", other)
    assert affinity_key("acme", TURN1, "s1") == affinity_key("acme", other, "s1")  # an explicit session wins


def test_affinity_map_is_a_bounded_lru_per_tier() -> None:
    m = AffinityMap(max_entries=2)
    m.remember("a", "mid", 1)
    m.remember("b", "mid", 0)
    assert m.get("a", "mid") == 1  # touches a
    m.remember("c", "mid", 0)
    assert len(m) == 2 and m.get("b", "mid") is None and m.get("a", "mid") == 1
    assert m.get("a", "full") is None  # routed to another tier this turn: no affinity


def test_one_tenants_flood_of_conversations_recycles_its_own_entries_not_anothers() -> None:
    m = AffinityMap(max_entries=100)
    for i in range(10):
        m.remember(f"v{i}", "mid", 1, "victim")
    for i in range(1_000):  # each a new conversation, none ever asked again
        m.remember(f"a{i}", "mid", 0, "attacker")
    assert len(m) == 100 and m.held_by("attacker") == 90
    assert [m.get(f"v{i}", "mid", "victim") for i in range(10)] == [1] * 10
    assert m.get("a999", "mid", "attacker") == 0 and m.get("a0", "mid", "attacker") is None
    assert m.get("v0", "mid", "attacker") is None  # keys are the tenant's own
    # a newcomer's first entry comes out of the tenant holding the most, not the victim's older ones
    m.remember("n0", "mid", 0, "newcomer")
    assert m.held_by("newcomer") == 1 and m.held_by("attacker") == 89 and m.held_by("victim") == 10


def test_a_tenant_over_its_share_early_gives_back_to_later_tenants_however_warm_its_entries() -> None:
    m = AffinityMap(max_entries=100)
    for i in range(100):  # alone, the whole map is its share
        m.remember(f"e{i}", "mid", 0, "early")
    for r in range(200):  # three later tenants each start a new conversation a round, while early keeps its warm
        for i in range(100):
            m.get(f"e{i}", "mid", "early")
        for t in ("b", "c", "d"):
            m.remember(f"{t}{r}", "mid", 1, t)
    share = 100 // 4
    assert len(m) == 100 and all(m.held_by(t) >= share - 1 for t in ("early", "b", "c", "d"))
    assert m.get("b199", "mid", "b") == 1  # later tenants keep their newest, not each other's leftovers


def test_the_tenant_most_over_its_share_pays_not_one_just_over_it_nor_one_under_it() -> None:
    m = AffinityMap(max_entries=100)
    for t, n in (("b", 30), ("a", 50), ("c", 10), ("d", 10)):  # b's are the least recently used of all
        for i in range(n):
            m.remember(f"{t}{i}", "mid", 0, t)
    m.remember("e0", "mid", 0, "e")
    assert [m.held_by(t) for t in "abcde"] == [49, 30, 10, 10, 1]
    for r in range(200):  # c, d and e start new conversations while a and b keep theirs warm
        for t, n in (("a", 50), ("b", 30)):
            for i in range(n):
                m.get(f"{t}{i}", "mid", t)
        for t in "cde":
            m.remember(f"{t}new{r}", "mid", 0, t)
    share = 100 // 5
    assert len(m) == 100 and all(m.held_by(t) >= share - 1 for t in "abcde")


def test_affinity_first_then_least_predicted_wait() -> None:
    reps = [ready(0, inflight=1, latency=0.1), ready(1, inflight=4, latency=0.1)]
    assert choose_replica(reps, preferred=1) == (reps[1], "affinity")
    assert choose_replica(reps) == (reps[0], "least predicted wait")
    # fewer in flight but each takes far longer: the other one is sooner
    slow = [ready(0, inflight=2, latency=5.0), ready(1, inflight=3, latency=0.5)]
    assert choose_replica(slow)[0] is slow[1]
    # a replica not measured yet counts as typical, so it gets traffic
    fresh = [ready(0, inflight=1, latency=0.2), ready(1, inflight=0)]
    assert choose_replica(fresh)[0] is fresh[1]


def test_unhealthy_and_open_breaker_replicas_are_skipped_even_with_affinity() -> None:
    down, tripped, ok = ready(0), ready(1), ready(2, inflight=9)
    down.mark("down", "exited with 1")
    tripped.breaker = CircuitBreaker(BreakerConfig(failures_to_open=1))
    tripped.breaker.failure("refused")
    assert choose_replica([down, tripped, ok], preferred=1) == (ok, "least predicted wait")
    none, why = choose_replica([down, tripped])
    assert none is None and "replica 0 down (exited with 1)" in why and "replica 1 circuit open" in why
    assert choose_replica([ok], exclude={2}) == (None, "no replica left to try")


def test_fleet_pick_follows_affinity_and_reports_open_breakers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tiers.fleet import Fleet

    cat = load_yaml(REPO_ROOT / "tiers" / "tiers.yaml", TierCatalogue)
    cat.tiers["mid"].replicas = 2
    fleet = Fleet(cat, client=None, models_dir=tmp_path, log_dir=tmp_path)  # type: ignore[arg-type]
    reps = fleet.replicas["mid"]
    for r in reps:
        r.mark("ready", "")
    key = affinity_key("acme", TURN1)
    first, _ = fleet.pick("mid", affinity=key)
    first.inflight = 5  # busy now, yet turn 2 still goes there
    fleet.served(key, first)
    again, why = fleet.pick("mid", affinity=affinity_key("acme", TURN2))
    assert again is first and why == "affinity"
    for r in reps:
        for _ in range(r.breaker.config.failures_to_open):
            r.breaker.failure("refused")
    assert fleet.unavailable()["mid"] == "circuit breaker open on every healthy replica"


TENANTS = ["a", "b", "c", "d"]
OPS = st.lists(st.one_of(
    st.tuples(st.just("remember"), st.sampled_from(TENANTS), st.integers(0, 7), st.sampled_from(["mid", "full"]),
              st.integers(0, 2)),
    st.tuples(st.just("get"), st.sampled_from(TENANTS), st.integers(0, 7), st.sampled_from(["mid", "full"]),
              st.just(0)),
), max_size=80)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(capacity=st.integers(1, 6), ops=OPS)
def test_affinity_map_matches_a_reference_that_evicts_from_the_tenant_holding_most(
        capacity: int, ops: list[tuple[str, str, int, str, int]]) -> None:
    """The reference: each tenant's entries as a dict in least-recently-used order; when over capacity, a tenant
    holding the most loses its first (the one remembering, when it is one of them and holds more than the new one)."""
    m = AffinityMap(max_entries=capacity)
    ref: dict[str, dict[str, tuple[str, int]]] = {t: {} for t in TENANTS}
    for op, tenant, k, tier, index in ops:
        key, own = f"k{k}", ref[tenant]
        if op == "get":
            hit = own.get(key)
            expected = hit[1] if hit is not None and hit[0] == tier else None
            assert m.get(key, tier, tenant) == expected
            if expected is not None:
                own[key] = own.pop(key)  # touched: now its tenant's most recent
            continue
        fresh = key not in own
        own.pop(key, None)
        own[key] = (tier, index)
        m.remember(key, tier, index, tenant)
        if fresh and sum(map(len, ref.values())) > capacity:
            held = {t: len(ref[t]) for t in TENANTS}
            losers = [t for t in TENANTS if m.held_by(t) != held[t]]
            assert len(losers) == 1 and m.held_by(losers[0]) == held[losers[0]] - 1
            victim = losers[0]
            assert held[victim] == max(held.values())  # always a tenant holding the most
            if held[tenant] == max(held.values()) and held[tenant] > 1:
                assert victim == tenant
            oldest, (oldest_tier, _) = next(iter(ref[victim].items()))
            assert (victim, oldest) != (tenant, key)  # never the conversation being remembered now
            del ref[victim][oldest]
            assert m.get(oldest, oldest_tier, victim) is None  # its least recently used went, no other one
        assert len(m) == sum(map(len, ref.values())) <= capacity
        assert all(m.held_by(t) == len(ref[t]) for t in TENANTS)
    for t in TENANTS:  # at the end, every entry the reference holds is there, with its replica
        for key, (tier, index) in list(ref[t].items()):
            assert m.get(key, tier, t) == index
