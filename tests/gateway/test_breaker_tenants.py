"""One tenant's requests that make a replica fail do not open its breaker for the others, nor move the ladder's
error rate, through the gateway.

The attacker's requests break the stub's stream (`STUB:die`, standing for any input a replica or provider chokes
on); before the breaker knew whose outcome each was, five of them took the only `mid` replica from every tenant for
the cool-down (tiers/breaker.py), and its 5xx made the error rate that takes every tenant down the degradation
ladder (gateway/ladder/signals.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.conftest import Gateway


def chat(gw: Gateway, key: str, content: str) -> int:
    with gw.client(key) as c:
        return c.post("/v1/chat/completions",
                      json={"model": "mid", "messages": [{"role": "user", "content": content}]}).status_code


def test_a_tenant_failing_its_own_requests_does_not_open_the_breaker_for_the_others(gateway: Gateway) -> None:
    gateway.store.create_tenant("attacker", "standard")
    attacker = gateway.store.issue_key("attacker", name="test")[1]
    (replica,) = gateway.app.state.services.fleet.replicas_of(gateway.app.state.services.catalogue.tiers["mid"])
    assert [chat(gateway, gateway.tenant_key, f"question {i}") for i in range(10)] == [200] * 10
    with ThreadPoolExecutor(4) as pool:
        failed = list(pool.map(lambda _: chat(gateway, attacker, "STUB:die"), range(8)))
    assert all(status >= 500 for status in failed), failed
    assert replica.breaker.state == "closed" and replica.breaker.consecutive_failures == 8
    assert chat(gateway, gateway.tenant_key, "and after?") == 200
    signals = gateway.app.state.services.ladder.signals
    assert signals.read()["error_rate"] == 0.0  # 8 of 19 were the attacker's 5xx
    assert set(signals._waits_of) == {"acme", "attacker"}  # each dispatch wait is known by its tenant


def test_two_tenants_failing_their_requests_together_do_not_open_the_breaker_for_the_others(gateway: Gateway) -> None:
    """Two attackers taking turns: the one tenant left out before was the one with the most failures, and the other's
    failures alone made a run of two tenants (which opened the breaker) and most of the ladder's error rate. The two
    other tenants' requests are served; each attacker has ten 5xx of its own, as the ladder needs to tell them."""
    for name in ("globex", "attacker-a", "attacker-b"):
        gateway.store.create_tenant(name, "standard")
    victim, a, b = (gateway.store.issue_key(n, name="test")[1] for n in ("globex", "attacker-a", "attacker-b"))
    (replica,) = gateway.app.state.services.fleet.replicas_of(gateway.app.state.services.catalogue.tiers["mid"])
    served = [chat(gateway, key, f"question {i}") for i in range(10) for key in (gateway.tenant_key, victim)]
    assert served == [200] * 20
    with ThreadPoolExecutor(4) as pool:
        failed = list(pool.map(lambda key: chat(gateway, key, "STUB:die"), [a, b] * 12))
    assert all(status >= 500 for status in failed), failed
    assert replica.breaker.state == "closed" and replica.breaker.consecutive_failures == 24
    assert chat(gateway, gateway.tenant_key, "and after?") == 200
    assert chat(gateway, victim, "and after?") == 200
    signals = gateway.app.state.services.ladder.signals
    assert signals.read()["error_rate"] == 0.0  # 24 of 46 were the attackers' 5xx
