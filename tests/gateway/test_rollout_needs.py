"""A tier's version never takes away what routing promised a request (gateway/pipeline/needs.py: vLLM's `top_k`,
tool calls). Routing picks the tier, then its rollout the version: a start refuses a candidate that lacks what the
version answering has, and a running rollout whose candidate lacks a need anyway (stored before that check, or under
a tiers file edited since) gives such requests to the baseline, every turn alike and not as the candidate's errors,
and copies none to a shadow; once `full`, the tier offers what the candidate has. The cascade's second attempt too.
Through a real gateway in front of stubs that record the bodies they get: `mid` is a vLLM whose v2 is a plain OpenAI
server and whose v3 cannot call tools."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.rollout.state import Rollout, RolloutEvent, Stage
from tests.conftest import Gateway, running_gateway
from tests.stubs import LADDER_PLANS, LADDER_PRICES, ServerThread, StubState, openai_tiers, stub_app, write_settings

USER = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
NEEDS = {"v2": ("top_k", {"top_k": 5}), "v3": ("tools", {"tools": [TOOL]})}


@pytest.fixture
def gw(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    """`mid`'s v1 (and `full`) answer from the recording stub, its v2 and v3 from `new`; `small` answers nothing
    (an empty answer: a cascade's retry)."""
    old, new, mute = StubState(), StubState(), StubState()
    with ServerThread(stub_app(old)).start() as v1, ServerThread(stub_app(new)).start() as v2, \
            ServerThread(stub_app(mute, reply="")).start() as empty:
        versions = [{"name": "v1"}, {"name": "v2", "dialect": "openai", "urls": [v2.url], "model": "stub-mid-2"},
                    {"name": "v3", "tools": False, "urls": [v2.url], "model": "stub-mid-3"}]
        tiers = {"small": {**LADDER_PRICES["small"], "url": empty.url},
                 "mid": {"url": v1.url, "serving": "v1", "versions": versions},
                 "full": {**LADDER_PRICES["full"], "url": v1.url}}
        settings = write_settings(tmp_path, prepared_models, openai_tiers(tiers, dialect="vllm"), LADDER_PLANS)
        with running_gateway(settings, old) as gateway:
            gateway.new, gateway.mute = new, mute  # type: ignore[attr-defined]
            yield gateway


def stored(gw: Gateway, candidate: str, stage: Stage, share: float = 1.0) -> None:
    """A rollout of `candidate` on `mid` as a store may hold one that no start of today's would accept."""
    rollouts = gw.app.state.services.rollouts
    now = time.time()
    r = Rollout("r1", "mid", candidate, "v1", stage, share, (), now, "cli", now, "cli", "before the check", 1)
    assert rollouts.store.save(r, RolloutEvent.of("start", r))
    rollouts.follow()


def post(gw: Gateway, body: dict[str, Any], key: str | None = None) -> Any:
    with gw.client(key or gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, **body})


@pytest.mark.parametrize("candidate", ["v2", "v3"])
def test_a_start_refuses_a_candidate_that_lacks_what_the_tier_offers(gw: Gateway, candidate: str) -> None:
    with gw.client(gw.admin_key) as c:
        r = c.post("/admin/rollouts", json={"tier": "mid", "version": candidate, "share": 0.2, "reason": "r"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("version", "version_lacks_capability"), error
        assert NEEDS[candidate][0] in error["message"] and "'v1'" in error["message"]
        assert c.get("/admin/rollouts").json()["data"] == []  # nothing started


@pytest.mark.parametrize("candidate", ["v2", "v3"])
def test_a_canary_candidate_that_lacks_a_need_leaves_the_request_to_the_baseline(gw: Gateway, candidate: str) -> None:
    stored(gw, candidate, "canary")  # every conversation on the candidate
    field, extra = NEEDS[candidate]
    for _ in range(2):  # every turn alike
        r = post(gw, {"model": "mid", **extra})
        assert r.status_code == 200, r.text
        assert (r.headers["x-tiergate-tier"], r.headers["x-tiergate-model-version"]) == ("mid", "v1")
        assert f"candidate {candidate}" in r.headers["x-tiergate-route-reason"]
    assert [b[field] for b in gw.stub.requests] == [extra[field]] * 2
    plain = post(gw, {"model": "mid"})  # one without the need: the candidate's
    assert plain.headers["x-tiergate-model-version"] == candidate
    assert [b["model"] for b in gw.new.requests] == [f"stub-mid-{candidate[1]}"]  # type: ignore[attr-defined]
    with gw.client(gw.admin_key) as c:
        versions = c.get("/admin/rollouts").json()["data"][0]["versions"]
    assert versions[candidate] == {"requests": 1, "errors": 0}, versions  # never counted as its error
    assert versions["v1"]["requests"] == 2


def test_a_full_rollout_s_candidate_is_what_the_tier_offers(gw: Gateway) -> None:
    stored(gw, "v2", "full")  # everyone on the plain OpenAI server
    named = post(gw, {"model": "mid", "top_k": 5})
    assert named.status_code == 400 and named.json()["error"]["param"] == "top_k", named.text
    routed = post(gw, {"model": "auto", "top_k": 5})
    assert routed.status_code == 200 and routed.headers["x-tiergate-tier"] == "small", routed.text
    assert gw.new.requests == []  # type: ignore[attr-defined]


def test_a_cascade_s_second_attempt_is_not_given_to_a_candidate_that_lacks_a_need(gw: Gateway) -> None:
    """`small` answers nothing, so the cascade retries on `mid`, whose canary candidate v2 cannot sample by top_k."""
    stored(gw, "v2", "canary")
    gw.store.create_tenant("cascading", "cascading")
    key = gw.store.issue_key("cascading", name="test")[1]
    r = post(gw, {"model": "auto", "top_k": 5}, key)
    assert r.status_code == 200, r.text
    assert [b["model"] for b in gw.mute.requests] == ["stub-small"]  # type: ignore[attr-defined]
    assert (r.headers["x-tiergate-tier"], r.headers["x-tiergate-model-version"]) == ("mid", "v1"), r.headers
    assert [(b["model"], b["top_k"]) for b in gw.stub.requests] == [("stub-mid", 5)]
    assert gw.new.requests == []  # type: ignore[attr-defined]


def test_a_shadow_does_not_copy_a_request_its_candidate_lacks_a_need_for(gw: Gateway) -> None:
    rollouts = gw.app.state.services.rollouts
    now = time.time()
    r = Rollout("r1", "mid", "v2", "v1", "shadow", 0.0, (), now, "cli", now, "cli", "r", 1, shadow=1.0)
    assert rollouts.store.save(r, RolloutEvent.of("start", r))
    rollouts.follow()
    new: StubState = gw.new  # type: ignore[attr-defined]
    assert post(gw, {"model": "mid", "top_k": 5}).status_code == 200
    assert post(gw, {"model": "mid", "temperature": 0.5}).status_code == 200  # copied: the shadow samples all
    deadline = time.time() + 10
    while not new.requests and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a copy of the first, sent first, would have come by now
    assert [(b["model"], b.get("top_k"), b.get("temperature")) for b in new.requests] == [("stub-mid-2", None, 0.5)]
