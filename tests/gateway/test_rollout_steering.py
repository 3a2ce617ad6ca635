"""One tenant cannot roll back a canary by steering its expensive requests onto it, end to end.

The attack as a client makes it: probe `x-tiergate-session` values with 1-token requests, keep those answered with
`x-tiergate-model-version: v2`, then send only slow requests (the stub's `STUB:slow`, standing for a long prefill)
in them, while another tenant's ordinary traffic fills both versions. The guards see each outcome's tenant (settle
records it) and hold the breach as that tenant's alone instead of rolling back.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import Gateway
from tests.gateway.test_rollout import admin, first_turn, servers, tenant_key, two_versions  # noqa: F401 (fixtures)
from tests.stubs import StubState


def chat(gw: Gateway, key: str, content: str, session: str | None = None) -> str:
    with gw.client(key) as c:
        r = c.post("/v1/chat/completions", headers={"x-tiergate-session": session} if session else {},
                   json={"model": "mid", "max_tokens": 1, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.headers["x-tiergate-model-version"]


def test_a_tenant_steering_slow_requests_onto_a_canary_does_not_roll_it_back(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:  # noqa: F811
    gw, _, _ = two_versions
    victim, attacker = tenant_key(gw, "victim"), tenant_key(gw, "attacker")
    r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.1, "reason": "canary of v2",
                                      "guards": {"breach_for_s": 1, "min_requests": 20}})
    assert r.status_code == 201, r.text
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda i: chat(gw, victim, first_turn(i)[1]["content"]), range(300)))
    assert versions.count("v2") >= 10
    found = [s for s in (f"s{i}" for i in range(200)) if chat(gw, attacker, "hi", s) == "v2"][:3]
    assert len(found) == 3
    with ThreadPoolExecutor(16) as pool:
        slow = list(pool.map(lambda i: chat(gw, attacker, "STUB:slow please", found[i % 3]), range(30)))
    assert set(slow) == {"v2"}
    held: list[str] = []
    deadline = time.monotonic() + 4  # 1 s of hysteresis, evaluated every 0.5 s: it would have rolled back by now
    while time.monotonic() < deadline:
        status = admin(gw, "/admin/rollouts").json()["data"][0]
        assert status["stage"] == "canary", status["reason"]
        if status["guard"] is not None:
            assert status["guard"]["breached"] == []
            held = status["guard"]["held"]
        time.sleep(0.25)
    assert len(held) == 1 and held[0].startswith("max_ttft_p95_ratio: ") and "tenant 'attacker' alone" in held[0]
