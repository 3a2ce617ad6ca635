"""A shadow end to end: the serving version answers and bills everyone; a sample of requests is also sent to the
candidate off the response's path, its latency, errors and divergence recorded, never returned, never billed.
Then the rollout's stage, shares, per-version traffic and shadow divergence on /metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from gateway.metrics import GatewayMetrics
from gateway.rollout.shadow import DIVERGENCE_WORDS, Shadow, divergence
from tests.gateway.rollout.test_service import CATALOGUE
from tests.gateway.test_rollout import admin, first_turn, tenant_key, two_versions  # noqa: F401 (a fixture)
from tests.stubs import REPLY, ServerThread, StubState, stub_app
from wire.chat_request import ChatCompletionRequest

OTHER_REPLY = "Bonjour from the second version ."  # half its words are the stub's, in order: divergence 0.5


@pytest.fixture
def servers() -> Iterator[list[tuple[ServerThread, StubState]]]:
    old, new = StubState(), StubState()
    started = [(ServerThread(stub_app(old)).start(), old), (ServerThread(stub_app(new, OTHER_REPLY)).start(), new)]
    try:
        yield started
    finally:
        for server, _ in started:
            server.stop()


def chat(gw: Any, key: str, i: int, *, stream: bool) -> tuple[dict[str, str], str]:
    """The answer's headers and text."""
    body = {"model": "mid", "messages": first_turn(i), "max_tokens": 8, "stream": stream}
    with gw.client(key) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return dict(r.headers), r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return dict(r.headers), "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def wait_for(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.time() + timeout_s
    while not (got := check()) and time.time() < deadline:
        time.sleep(0.1)
    return got


def test_a_shadow_compares_the_candidate_without_touching_answers_or_bills(two_versions: Any) -> None:  # noqa: F811
    gw, _, new = two_versions
    key = tenant_key(gw, "shadowed")
    n = 12
    plain = [chat(gw, key, i, stream=i % 2 == 1) for i in range(n)]  # no rollout yet
    r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "shadow": 1.0, "reason": "compare v2",
                                      "guards": {"max_divergence": 0.9, "min_requests": 5,  # stubs: ms of noise
                                                 "max_ttft_p95_ratio": None, "max_tpot_p95_ratio": None}})
    assert (r.status_code, r.json()["stage"]) == (201, "shadow"), r.text
    shadowed = [chat(gw, key, i, stream=i % 2 == 1) for i in range(n)]  # the same requests, shadowed
    assert [(h["x-tiergate-model-version"], text) for h, text in shadowed] == [("v1", REPLY)] * n
    assert [text for _, text in plain] == [REPLY] * n  # the same answers as without the shadow
    assert wait_for(lambda: len(new.requests) == n)  # v2's upstream got each one, off the response's path
    assert {b["model"] for b in new.requests} == {"stub-mid-2"} and all(b["max_tokens"] == 8 for b in new.requests)
    rows = [row for row in gw.ledger_rows() if row.tenant == "shadowed"]
    assert len(rows) == 2 * n and {row.model_version for row in rows} == {"v1"}  # no row for a shadow call
    before, after = rows[:n], rows[n:]
    assert sum(r.price_usd for r in before) == sum(r.price_usd for r in after) > Decimal(0)
    assert [(r.input_tokens, r.output_tokens) for r in before] == [(r.input_tokens, r.output_tokens) for r in after]
    status = wait_for(lambda: (s := admin(gw, "/admin/rollouts").json()["data"][0])["guard"] and
                      s["guard"]["versions"]["v2"]["compared"] == n and s)
    assert status["versions"]["v2"] == {"requests": n, "errors": 0}
    assert status["guard"]["versions"]["v2"]["divergence"] == 0.5 and status["guard"]["breached"] == []
    assert status["guard"]["versions"]["v2"]["ttft_p95_s"] is not None
    with gw.client(gw.admin_key) as c:
        metrics = c.get("/metrics").text
    assert 'tiergate_rollout_stage{candidate="v2",stage="shadow",tier="mid"} 1.0' in metrics
    assert f'tiergate_rollout_shadow_requests_total{{result="ok",tier="mid",version="v2"}} {float(n)}' in metrics
    assert 'tiergate_rollout_divergence{tier="mid",version="v2"} 0.5' in metrics
    assert 'tiergate_rollout_shadow_share{tier="mid",version="v2"} 1.0' in metrics
    assert f'tiergate_version_requests_total{{result="ok",tier="mid",version="v1"}} {float(n)}' in metrics
    assert 'tiergate_version_time_to_first_token_seconds_count{tier="mid",version="v1"}' in metrics
    r = admin(gw, "/admin/rollouts/mid/promote", {"share": 0.0, "reason": "v2 looks right"})
    assert (r.status_code, r.json()["stage"], r.json()["share"]) == (200, "canary", 0.0)
    chat(gw, key, 99, stream=False)
    time.sleep(0.5)
    assert len(new.requests) == n  # a canary copies nothing
    with gw.client(gw.admin_key) as c:
        metrics = c.get("/metrics").text
    assert 'tiergate_rollout_share{tier="mid",version="v1"} 1.0' in metrics
    assert 'tiergate_rollout_stage{candidate="v2",stage="canary",tier="mid"} 1.0' in metrics


def test_divergence_is_one_minus_the_word_similarity() -> None:
    assert divergence(REPLY, REPLY) == 0.0
    assert divergence(REPLY, OTHER_REPLY) == 0.5
    assert divergence("a b c", "") == 1.0 and divergence("", "") == 0.0
    assert divergence("x " * 100_000, "y " * 100_000) == 1.0  # long answers: only their first words compared


def test_shadow_calls_beyond_the_limit_are_dropped_and_counted() -> None:
    class Rollouts:
        rollout = type("R", (), {"tier": "mid", "candidate": "v2"})()

        def __init__(self) -> None:
            self.observed: list[float | None] = []

        def shadow_of(self, tier: Any, request_id: str) -> Any:
            return self.rollout, tier

        def observe_shadow(self, rollout: Any, **kw: Any) -> None:
            self.observed.append(kw["divergence"])

    class Caller:
        def __init__(self) -> None:
            self.release = asyncio.Event()
            self.opened = 0

        async def open(self, tier: Any, body: Any, affinity: Any, **kw: Any) -> Any:
            self.opened += 1
            await self.release.wait()

            async def chunks() -> Any:
                yield {"choices": [{"delta": {"content": REPLY}, "finish_reason": "stop"}]}
            return chunks()

    async def scenario() -> tuple[int, list[float | None], str]:
        metrics, rollouts, caller = GatewayMetrics(), Rollouts(), Caller()
        shadow = Shadow(rollouts=rollouts, caller=caller, metrics=metrics, max_in_flight=3)  # type: ignore[arg-type]
        req = ChatCompletionRequest.model_validate({"model": "mid", "messages": first_turn(1)})
        for i in range(10):
            shadow.send(CATALOGUE.tiers["mid"], f"r{i}", req, 8, REPLY)  # returns at once: nothing awaited
        await asyncio.sleep(0.05)
        caller.release.set()
        await shadow.tasks.drain()
        return caller.opened, rollouts.observed, metrics.render().decode()

    opened, observed, text = asyncio.run(scenario())
    assert opened == 3 and observed == [0.0, 0.0, 0.0]
    assert 'tiergate_rollout_shadow_requests_total{result="dropped",tier="mid",version="v2"} 7.0' in text


class _Rollouts:
    """A shadow sampling every request; what it observed, by tenant."""

    rollout = type("R", (), {"tier": "mid", "candidate": "v2"})()

    def __init__(self) -> None:
        self.tenants: list[str | None] = []

    def shadow_of(self, tier: Any, request_id: str) -> Any:
        return self.rollout, tier

    def observe_shadow(self, rollout: Any, **kw: Any) -> None:
        self.tenants.append(kw["tenant"])


class _HeldCaller:
    """A candidate that answers once released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def open(self, tier: Any, body: Any, affinity: Any, **kw: Any) -> Any:
        await self.release.wait()

        async def chunks() -> Any:
            yield {"choices": [{"delta": {"content": REPLY}, "finish_reason": "stop"}]}
        return chunks()


def test_one_tenants_flood_cannot_take_every_shadow_place() -> None:
    """A tenant flooding a shadowed tier took all the places, every other tenant's copy dropped: the candidate was
    then judged on the flooder's requests alone (the others too few to hold its breach)."""
    async def scenario() -> list[str | None]:
        rollouts, caller = _Rollouts(), _HeldCaller()
        shadow = Shadow(rollouts=rollouts, caller=caller, metrics=GatewayMetrics(),  # type: ignore[arg-type]
                        max_in_flight=8)
        req = ChatCompletionRequest.model_validate({"model": "mid", "messages": first_turn(1)})
        for i in range(20):
            shadow.send(CATALOGUE.tiers["mid"], f"a{i}", req, 8, REPLY, tenant="flooder")
        shadow.send(CATALOGUE.tiers["mid"], "b0", req, 8, REPLY, tenant="other")
        caller.release.set()
        await shadow.tasks.drain()
        return rollouts.tenants

    tenants = asyncio.run(scenario())
    assert "other" in tenants
    assert tenants.count("flooder") == 4  # MAX_PER_TENANT


def test_a_shadow_keeps_only_the_words_it_compares_of_the_served_answer() -> None:
    """Each call in flight held the whole answer the client got (up to its output cap), while the comparison reads
    only its first DIVERGENCE_WORDS words."""
    held: list[str] = []

    class Recording(Shadow):
        async def _run(self, rollout: Any, candidate: Any, body: Any, served: str, tenant: str | None = None,
                       **kw: Any) -> None:
            held.append(served)

    async def scenario() -> None:
        shadow = Recording(rollouts=_Rollouts(), caller=_HeldCaller(), metrics=GatewayMetrics())  # type: ignore[arg-type]
        req = ChatCompletionRequest.model_validate({"model": "mid", "messages": first_turn(1)})
        shadow.send(CATALOGUE.tiers["mid"], "r0", req, 8, "word " * 1_000_000, tenant="t")
        await shadow.tasks.drain()

    asyncio.run(scenario())
    assert held and held[0].split() == ["word"] * DIVERGENCE_WORDS
    assert divergence("x " * 300 + "y", "x " * 300 + "z") == 0.0  # the same first words: the same comparison
