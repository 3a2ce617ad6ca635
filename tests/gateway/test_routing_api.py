"""Routing through the HTTP API: `auto` by predicted difficulty and budget, replica affinity across turns,
circuit breakers, and the cascade from an empty cheap answer to the next tier, all in headers and ledger.

The tiers: `small` is a stub that always answers empty; `mid` has two stub replicas; `full` is a stub.
The difficulty model is a fake that reads the last message: "hard" and "medium" prompts need dearer tiers.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import Settings
from quotas.dispatch import Ticket
from quotas.ledger import LedgerUnavailable
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.money import to_pico
from tests.conftest import Gateway, running_gateway
from tests.stubs import REPLY, ServerThread, StubState, free_port, stub_app
from tiers.breaker import BreakerConfig, CircuitBreaker
from tiers.predictor import PredictorSource

PLANS = """
default_plan: routed
plans:
  routed:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing:
      quality_floor: 0.8
      budget_thresholds: [{below_fraction: 0.5, quality_floor: 0.6}]
    limits: {budget_day_usd: "1"}
  cascading:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true}
  shedding:
    allowed_tiers: [small, mid, full]
    default_tier: full
    max_queue_wait_s: 5
    shed_to_cheaper: true
"""
LADDER = """
levels:
  - {level: 0, name: normal}
  - {level: 1, name: no-cascade, actions: [{disable_cascade: true}]}
  - {level: 2, name: remap, actions: [{remap_tiers: {full: mid}}]}
"""


def tiers_yaml(small: str, mid: list[str], full: str) -> str:
    def tier(name: str, urls: list[str], price_in: str, price_out: str) -> str:
        return (f"  {name}:\n    backend: openai\n    model: stub-{name}\n    urls: {json.dumps(urls)}\n"
                f"    price_per_1k_input: \"{price_in}\"\n    price_per_1k_output: \"{price_out}\"\n"
                f"    hardware_cost_per_hour: \"1\"\n    context_limit: 4096\n")
    return ("tiers:\n" + tier("small", [small], "0.0001", "0.0002") + tier("mid", mid, "0.0010", "0.0020")
            + tier("full", [full], "0.0030", "0.0060"))


def empty_stub(state: StubState) -> Litestar:
    """An upstream whose model says nothing (one end-of-sequence token, then stop)."""

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-small", "object": "model"}]}

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        state.requests.append(json.loads(await request.body()))
        return Stream(_empty_sse(), media_type="text/event-stream")

    return Litestar([models, chat])


async def _empty_sse() -> AsyncIterator[bytes]:
    for data in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
                 {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                 {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}):
        yield f"data: {json.dumps({'id': 'e', 'object': 'chat.completion.chunk', **data})}\n\n".encode()
    yield b"data: [DONE]\n\n"


class FakeDifficulty:
    version = "fake-1"

    def predict(self, messages: list[dict[str, Any]]) -> dict[str, float]:
        text = messages[-1]["content"]
        if "hard" in text:
            return {"small": 0.2, "mid": 0.5, "full": 1.0}
        if "medium" in text:
            return {"small": 0.4, "mid": 0.7, "full": 1.0}
        return {"small": 0.95, "mid": 0.97, "full": 1.0}


class Fleet3:
    """The stub upstreams: `small` (empty), `mid` replicas 0 and 1, `full`."""

    def __init__(self) -> None:
        self.small, self.mid0, self.mid1, self.full = StubState(), StubState(), StubState(), StubState()
        self.servers = [ServerThread(empty_stub(self.small)).start()] + [
            ServerThread(stub_app(s)).start() for s in (self.mid0, self.mid1, self.full)]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture
def fleet3() -> Iterator[Fleet3]:
    f = Fleet3()
    yield f
    f.stop()


@pytest.fixture
def routed_settings(gateway_settings: Settings, fleet3: Fleet3, tmp_path: Path) -> Settings:
    s = fleet3.servers
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(s[0].url, [s[1].url, s[2].url], s[3].url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    (tmp_path / "ladder.yaml").write_text(LADDER)
    return gateway_settings.model_copy(update={"ladder_file": tmp_path / "ladder.yaml", "ladder_tick_s": 0.05})


def with_difficulty_model(gw: Gateway, tmp_path: Path) -> None:
    artifact = tmp_path / "difficulty.json"
    artifact.write_text("{}")
    gw.app.state.services.pipeline.route.predictor = PredictorSource(artifact, lambda _: FakeDifficulty())


@pytest.fixture
def routed(routed_settings: Settings, fleet3: Fleet3, tmp_path: Path) -> Iterator[Gateway]:
    with running_gateway(routed_settings, fleet3.mid0, plan="routed") as gw:
        with_difficulty_model(gw, tmp_path)
        yield gw


def sample(metrics: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def chat(gw: Gateway, content: str, *, key: str | None = None, **body: object):  # type: ignore[no-untyped-def]
    messages = body.pop("messages", [{"role": "user", "content": content}])
    with gw.client(key or gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": "auto", "messages": messages} | body)


def test_auto_routes_by_predicted_difficulty_and_says_why(routed: Gateway) -> None:
    easy, medium, hard = chat(routed, "easy"), chat(routed, "medium"), chat(routed, "hard")
    assert [r.status_code for r in (easy, medium, hard)] == [200, 200, 200]
    assert [r.headers["x-tiergate-tier"] for r in (easy, medium, hard)] == ["small", "full", "full"]
    assert easy.headers["x-tiergate-route-reason"] == (
        "auto: small predicted fidelity 0.95 >= floor 0.8 (difficulty model fake-1)")
    assert "x-tiergate-cascade" not in easy.headers  # this plan does not cascade, even an empty answer
    rows = {r.request_id: r for r in routed.ledger_rows()}
    assert rows[easy.headers["x-tiergate-request-id"]].route_reason == easy.headers["x-tiergate-route-reason"]
    # an explicit tier is not second-guessed
    r = chat(routed, "easy", model="full")
    assert r.headers["x-tiergate-tier"] == "full" and r.headers["x-tiergate-route-reason"] == "requested"


def test_a_tenant_low_on_budget_is_routed_to_a_cheaper_tier(routed: Gateway) -> None:
    assert chat(routed, "medium").headers["x-tiergate-tier"] == "full"
    backend = routed.app.state.services.quota_backend  # spend 60% of the $1 day budget
    backend.reserve_now(ReservationRequest("earlier", "acme", (ScopeLimits("t"),), 0, to_pico(Decimal("0.6"))))
    r = chat(routed, "medium")
    assert r.headers["x-tiergate-tier"] == "mid"
    assert re.search(r"floor 0.6 \(budget 4\d% left < 50%\)", r.headers["x-tiergate-route-reason"])


def test_the_ladder_remaps_after_routing(routed: Gateway) -> None:
    with routed.client(routed.admin_key) as c:
        assert c.post("/admin/degrade/", json={"level": 2, "reason": "test"}).status_code == 200
    r = chat(routed, "hard")  # `auto` chooses full, the level moves it to mid
    assert r.headers["x-tiergate-tier"] == "mid"
    assert r.headers["x-tiergate-route-reason"].endswith("; degrade level 2: full -> mid")


def test_turn_two_goes_to_the_replica_that_served_turn_one(routed: Gateway, fleet3: Fleet3) -> None:
    reps = routed.app.state.services.fleet.replicas["mid"]
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about KV caches"}]
    assert chat(routed, "", model="mid", messages=turn1).status_code == 200
    served = 0 if fleet3.mid0.requests else 1
    stubs = [fleet3.mid0, fleet3.mid1]
    assert len(stubs[served].requests) == 1 and not stubs[1 - served].requests
    reps[served].inflight += 3  # busier now: without affinity, turn 2 would go to the other replica
    try:
        turn2 = [*turn1, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "and then?"}]
        assert chat(routed, "", model="mid", messages=turn2).status_code == 200
        assert len(stubs[served].requests) == 2 and not stubs[1 - served].requests
        # another conversation is not pinned there: it goes where the wait is shorter
        other = [{"role": "user", "content": "something else entirely"}]
        assert chat(routed, "", model="mid", messages=other).status_code == 200
        assert len(stubs[1 - served].requests) == 1
    finally:
        reps[served].inflight -= 3


def test_an_unreachable_replica_opens_its_breaker_and_the_request_is_retried(routed: Gateway,
                                                                               fleet3: Fleet3) -> None:
    services = routed.app.state.services
    dead = services.fleet.replicas["mid"][0]
    dead.url = f"http://127.0.0.1:{free_port()}"
    dead.breaker = CircuitBreaker(BreakerConfig(failures_to_open=1, cooldown_s=60))
    r = chat(routed, "", model="mid")
    assert r.status_code == 200 and len(fleet3.mid1.requests) == 1
    assert dead.breaker.state == "open"
    with routed.client(routed.admin_key) as c:
        metrics = c.get("/metrics").text
    assert sample(metrics, "tiergate_replica_breaker_state", tier="mid", replica="0") == 2.0
    dead.mark("ready", "")  # a health check passes, but the breaker still keeps requests away
    for _ in range(3):
        assert chat(routed, "", model="mid").status_code == 200
    assert len(fleet3.mid1.requests) == 4


def test_a_replica_that_sent_chunks_is_heard_from_and_one_that_did_not_is_not(routed: Gateway,
                                                                              fleet3: Fleet3) -> None:
    """What lets a busy replica's unanswered health check pass (tiers/fleet.py `BUSY_GRACE_S`): when our requests
    there began and when it last sent one of them a chunk; a replica never asked was never heard from."""
    reps = routed.app.state.services.fleet.replicas["mid"]
    assert [rep.last_heard for rep in reps] == [None, None]
    before = time.monotonic()
    assert chat(routed, "", model="mid").status_code == 200
    served = 0 if fleet3.mid0.requests else 1
    heard, asked = reps[served].last_heard, reps[served].busy_since
    assert heard is not None and asked is not None and before <= asked <= heard <= time.monotonic()
    assert reps[1 - served].last_heard is None and reps[1 - served].busy_since is None


@pytest.mark.parametrize(("steer", "code"), [("STUB:schema-fail", "response_format_failed"),
                                             ("STUB:refused-late", "invalid_value")])
def test_a_request_that_fails_by_its_own_format_is_the_tenants_400_and_opens_no_breaker(
        routed: Gateway, fleet3: Fleet3, steer: str, code: str) -> None:
    """One tenant's response_format whose grammar cannot go on (our engine's `response_format_failed`), or that the
    engine refuses as its stream starts (a 400's body as the stream's error event, marked with its status: the format
    refused to the tenant in between, engine/answer_frames.py), is that request's error: before, each was a 500 that
    the replica's breaker counted (a 502 to the tenant), and a few such requests took the tier away from every
    tenant."""
    rep = routed.app.state.services.fleet.replicas["full"][0]
    rep.breaker = CircuitBreaker(BreakerConfig(failures_to_open=1, cooldown_s=60))
    for _ in range(3):
        r = chat(routed, steer, model="full")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "response_format", code)
    assert rep.breaker.state == "closed" and len(fleet3.full.requests) == 3  # tried once each, not retried
    r = chat(routed, "", model="full")
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "full"


def test_an_upstreams_own_fault_as_an_invalid_request_event_is_the_tiers(routed: Gateway) -> None:
    """An error event's type is not whose fault it is: an upstream's bad key comes as an `invalid_request_error`
    too, and it is the tier's failure (a 502, counted by the breaker), never the tenant's 400 with the provider's
    message."""
    rep = routed.app.state.services.fleet.replicas["full"][0]
    rep.breaker = CircuitBreaker(BreakerConfig(failures_to_open=1, cooldown_s=60))
    r = chat(routed, "STUB:bad-key-event", model="full")
    assert r.status_code == 502, r.text
    assert "Incorrect API key" not in r.text
    assert rep.breaker.state == "open"


def test_a_tier_whose_breakers_are_all_open_is_routed_around(routed: Gateway) -> None:
    for rep in routed.app.state.services.fleet.replicas["full"]:
        for _ in range(rep.breaker.config.failures_to_open):
            rep.breaker.failure("refused")
    r = chat(routed, "hard")
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid"
    assert "full unavailable (circuit breaker open on every healthy replica); fell back to mid" in \
        r.headers["x-tiergate-route-reason"]


def test_an_overloaded_tier_is_shed_only_off_its_own_cores(routed_settings: Settings, fleet3: Fleet3) -> None:
    """full is backed up (10,000 tokens ahead at 100 tokens/s); where mid shares its cores, shedding skips mid,
    and where every tier shares them the request is refused with full's wait instead of run slowly."""
    with running_gateway(routed_settings, fleet3.mid0, plan="shedding") as gw:
        services = gw.app.state.services
        queue = services.queues["full"]
        queue.in_flight, queue.tokens_per_s = queue.capacity, 100.0
        queue.waiting[0].append(Ticket("other", 0, 1.0, 10_000, seq=-1))
        try:
            assert chat(gw, "x", model="full").headers["x-tiergate-tier"] == "mid"  # apart: the closest cheaper
            services.fleet.hardware_groups = {"full": "cpu:full+mid", "mid": "cpu:full+mid", "small": "cpu:small"}
            r = chat(gw, "x", model="full")
            assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small"
            assert r.headers["x-tiergate-route-reason"] == "full predicted wait 100.0s > 5.0s; shed to small"
            services.fleet.hardware_groups = dict.fromkeys(("small", "mid", "full"), "cpu:all")
            r = chat(gw, "x", model="full")
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 100
            assert "mid: shares full's hardware (cpu:all): no capacity of its own" in r.json()["error"]["message"]
        finally:
            queue.waiting[0].clear()
            queue.in_flight = 0
    assert not fleet3.full.requests


@pytest.fixture
def cascading(routed_settings: Settings, fleet3: Fleet3, tmp_path: Path) -> Iterator[Gateway]:
    with running_gateway(routed_settings, fleet3.mid0, plan="cascading") as gw:
        with_difficulty_model(gw, tmp_path)
        yield gw


def test_an_empty_cheap_answer_cascades_once_and_both_attempts_are_billed(cascading: Gateway,
                                                                           fleet3: Fleet3) -> None:
    r = chat(cascading, "easy")
    assert r.status_code == 200, r.text
    rid = r.headers["x-tiergate-request-id"]
    assert r.headers["x-tiergate-cascade"] == "small->mid" and r.headers["x-tiergate-tier"] == "mid"
    body = r.json()
    assert body["choices"][0]["message"]["content"] == REPLY and body["model"] == "mid"
    assert body["id"] == f"chatcmpl-{rid}"
    assert len(fleet3.small.requests) == 1 and len(fleet3.mid0.requests) + len(fleet3.mid1.requests) == 1
    first, second = sorted(cascading.ledger_rows(), key=lambda row: row.request_id)
    assert (first.request_id, first.tier, first.cascade_of) == (rid, "small", None)
    assert (second.request_id, second.tier, second.cascade_of) == (f"{rid}-cascade", "mid", rid)
    assert first.price_usd > 0 and second.price_usd > 0
    assert first.route_reason.endswith(f"empty answer: cascaded to mid as {rid}-cascade")
    assert second.route_reason == "cascade from small (empty answer)"
    assert r.headers["x-tiergate-route-reason"] == second.route_reason
    with cascading.client(cascading.admin_key) as c:
        metrics = c.get("/metrics").text
    assert sample(metrics, "tiergate_cascades_total", from_tier="small", to_tier="mid", reason="empty") == 1.0


def test_a_reserved_retry_that_never_runs_is_settled(cascading: Gateway, fleet3: Fleet3,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry is reserved before the first attempt settles; when that settlement fails (its row late past the
    ledger's timeout) the retry never runs, and is settled as cancelled, not left holding its reservation."""
    ledger = cascading.app.state.services.pipeline.settler.ledger
    real, calls = ledger.wait_durable, []

    async def first_is_late(written: Any, **kwargs: Any) -> None:
        calls.append(written)
        if len(calls) == 1:  # the first attempt's own wait for its row
            raise LedgerUnavailable("the test's ledger: late")
        await real(written, **kwargs)

    monkeypatch.setattr(ledger, "wait_durable", first_is_late)
    r = chat(cascading, "easy")
    assert r.status_code == 503, r.text
    rid = r.headers["x-tiergate-request-id"]
    deadline = time.monotonic() + 10
    while len(rows := cascading.ledger_rows()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first, second = sorted(rows, key=lambda row: row.request_id)
    assert (first.request_id, first.tier) == (rid, "small")
    assert (second.request_id, second.cascade_of, second.status) == (f"{rid}-cascade", rid, "cancelled")
    assert second.price_usd == 0 and second.output_tokens == 0
    assert len(fleet3.small.requests) == 1 and fleet3.mid0.requests == fleet3.mid1.requests == []  # no retry ran


def test_streams_and_explicit_tiers_are_not_cascaded(cascading: Gateway) -> None:
    with cascading.client(cascading.tenant_key) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "auto", "messages": [{"role": "user", "content": "easy"}], "stream": True}) as r:
        assert r.headers["x-tiergate-tier"] == "small" and "x-tiergate-cascade" not in r.headers
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    r = chat(cascading, "easy", model="small")
    assert r.headers["x-tiergate-tier"] == "small" and "x-tiergate-cascade" not in r.headers
    assert len(cascading.ledger_rows()) == 2


def test_the_ladder_can_disable_the_cascade(cascading: Gateway) -> None:
    with cascading.client(cascading.admin_key) as c:
        assert c.post("/admin/degrade/", json={"level": 1, "reason": "test"}).status_code == 200
    r = chat(cascading, "easy")
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small"
    assert "x-tiergate-cascade" not in r.headers and r.json()["choices"][0]["message"]["content"] == ""
    assert r.headers["x-tiergate-degrade-actions"] == "disable_cascade"
    assert r.headers["x-tiergate-route-reason"].endswith("empty answer, not cascaded (degrade level 1)")
    (row,) = cascading.ledger_rows()
    assert row.degrade_actions == "disable_cascade"


def test_a_cascade_never_escalates_to_a_tier_the_ladder_moves_off(routed_settings: Settings, fleet3: Fleet3,
                                                                    tmp_path: Path) -> None:
    """At a level that remaps `mid` to `small`, an empty `small` answer is not cascaded back onto `mid`."""
    routed_settings.ladder_file.write_text(
        "levels:\n  - {level: 0, name: normal}\n"
        "  - {level: 1, name: off-mid, actions: [{remap_tiers: {mid: small}}]}\n")
    with running_gateway(routed_settings, fleet3.mid0, plan="cascading") as gw:
        with_difficulty_model(gw, tmp_path)
        with gw.client(gw.admin_key) as c:
            assert c.post("/admin/degrade/", json={"level": 1, "reason": "test"}).status_code == 200
        r = chat(gw, "easy")
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small", r.text
        assert "x-tiergate-cascade" not in r.headers
        assert r.headers["x-tiergate-route-reason"].endswith("not cascaded to mid (degrade level 1 remaps it)")
        assert len(fleet3.mid0.requests) + len(fleet3.mid1.requests) == 0
        assert [row.tier for row in gw.ledger_rows()] == ["small"]
