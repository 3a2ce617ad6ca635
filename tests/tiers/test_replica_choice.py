"""Replica choice: affinity first, then least predicted wait; unhealthy replicas and open breakers skipped."""

from __future__ import annotations

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
    # below its share a tenant still takes the least recently used entry, whoever's it is
    m.remember("n0", "mid", 0, "newcomer")
    assert m.held_by("newcomer") == 1 and len(m) == 100


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
