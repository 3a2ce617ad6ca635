"""Rollouts end to end: a real gateway in front of two stub upstreams, the two versions of tier `mid`.

A canary sends its share of new conversations to the candidate and every later turn where its first went; a named
tenant is always on it; promote puts everyone there and rollback everyone back; the audit trail says who and why;
a cached answer never crosses versions; bad admin input changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.rollout.assign import BUCKETS, bucket, conversation_id
from gateway.settings import Settings
from tests.conftest import PLANS_YAML, Gateway, running_gateway
from tests.stubs import ServerThread, StubState, free_port, stub_app

CONVERSATIONS = 400
SHARE = 0.2


def tiers_yaml(v1: str, v2: str, dead: str) -> str:
    tier = """
    price_per_1k_input: "0.0010"
    price_per_1k_output: "0.0020"
    hardware_cost_per_hour: "3.60"
    context_limit: 4096"""
    return f"""
tiers:
  small:
    backend: openai
    model: stub-small
    urls: ["{dead}"]{tier}
  mid:
    backend: openai
    model: stub-mid
    urls: ["{v1}"]{tier}
    serving: v1
    versions:
      - name: v1
      - name: v2
        model: stub-mid-2
        urls: ["{v2}"]
  full:
    backend: openai
    model: stub-full
    urls: ["{v1}"]{tier}
"""


@pytest.fixture
def servers() -> Iterator[list[tuple[ServerThread, StubState]]]:
    """v1's stub upstream (which also answers tier `full`) and v2's."""
    states = [StubState(), StubState()]
    started = [(ServerThread(stub_app(state)).start(), state) for state in states]
    try:
        yield started
    finally:
        for server, _ in started:
            server.stop()


@pytest.fixture
def two_versions(tmp_path: Path, prepared_models: Path,
                 servers: list[tuple[ServerThread, StubState]]) -> Iterator[tuple[Gateway, StubState, StubState]]:
    (old_server, old), (new_server, new) = servers
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(old_server.url, new_server.url,
                                                    f"http://127.0.0.1:{free_port()}"))
    (tmp_path / "plans.yaml").write_text(PLANS_YAML)
    settings = Settings(data_dir=tmp_path / "data", models_dir=prepared_models, tiers_file=tmp_path / "tiers.yaml",
                        plans_file=tmp_path / "plans.yaml", max_body_bytes=64 * 1024)
    with running_gateway(settings, old) as gw:
        yield gw, old, new


def tenant_key(gw: Gateway, name: str, plan: str = "nocache") -> str:
    gw.store.create_tenant(name, plan)
    return gw.store.issue_key(name, name="test")[1]


def ask(gw: Gateway, key: str, messages: list[dict[str, str]]) -> httpx.Response:
    with gw.client(key) as c:  # temperature 0: an answer the cache may keep
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": messages, "max_tokens": 8,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def admin(gw: Gateway, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    with gw.client(gw.admin_key) as c:
        return c.post(path, json=body) if body is not None else c.get(path)


def first_turn(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Question number {i}?"}]


def test_a_canary_sends_its_share_of_new_conversations_and_later_turns_follow_the_first(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, new = two_versions
    key = tenant_key(gw, "many")
    r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": SHARE, "reason": "new weights"})
    assert r.status_code == 201, r.text

    def conversation(i: int) -> tuple[str, str]:
        first = ask(gw, key, first_turn(i))
        answer = first.json()["choices"][0]["message"]["content"]
        later = [*first_turn(i), {"role": "assistant", "content": answer}, {"role": "user", "content": "And why?"}]
        return first.headers["x-tiergate-model-version"], ask(gw, key, later).headers["x-tiergate-model-version"]

    with ThreadPoolExecutor(8) as pool:
        turns = list(pool.map(conversation, range(CONVERSATIONS)))
    assert all(first == later for first, later in turns)  # no conversation changes version mid-way
    # exactly the conversations whose bucket, salted by this rollout's id, is below the share: the id is drawn at
    # random, so the count alone varies from run to run (a 3-sigma bound on it failed in 0.22% of runs); that the
    # buckets are uniform, so this is the share of conversations, is tests/gateway/rollout/test_assign.py's
    rollout_id = r.json()["id"]
    chosen = [bucket(conversation_id("many", first_turn(i)), rollout_id) < SHARE * BUCKETS
              for i in range(CONVERSATIONS)]
    assert [first == "v2" for first, _ in turns] == chosen
    on_new = sum(first == "v2" for first, _ in turns)
    sigma = (CONVERSATIONS * SHARE * (1 - SHARE)) ** 0.5  # binomial: 80 expected, sigma 8
    assert abs(on_new - CONVERSATIONS * SHARE) <= 5 * sigma, on_new  # and about the share (outside: 8e-7 of runs)
    assert len(new.requests) == 2 * on_new  # the candidate's own upstream answered them, and only them
    assert all(body["model"] == "stub-mid-2" for body in new.requests)
    rows = [row for row in gw.ledger_rows() if row.tenant == "many"]
    assert sorted(row.model_version for row in rows) == sorted(v for pair in turns for v in pair)
    status = admin(gw, "/admin/rollouts").json()["data"][0]
    assert status["versions"]["v2"] == {"requests": 2 * on_new, "errors": 0}
    assert status["versions"]["v1"]["requests"] == 2 * (CONVERSATIONS - on_new)


def test_named_tenants_promote_rollback_and_the_audit_trail(two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, _ = two_versions
    vip, other = tenant_key(gw, "vip"), tenant_key(gw, "other")

    def versions(key: str) -> set[str]:
        return {ask(gw, key, first_turn(i)).headers["x-tiergate-model-version"] for i in range(20)}

    assert versions(other) == {"v1"}  # no rollout: the serving version answers
    assert admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.0, "tenants": ["vip"],
                                         "reason": "vip tries it"}).status_code == 201
    assert (versions(vip), versions(other)) == ({"v2"}, {"v1"})
    r = admin(gw, "/admin/rollouts/mid/promote", {"reason": "vip is happy"})
    assert (r.status_code, r.json()["stage"]) == (200, "full")
    assert (versions(vip), versions(other)) == ({"v2"}, {"v2"})
    assert admin(gw, "/admin/rollouts/mid/rollback", {"reason": "errors in v2"}).status_code == 200
    assert (versions(vip), versions(other)) == ({"v1"}, {"v1"})
    admin_id = next(k.key_id for k in gw.store.list_keys(None) if k.is_admin)
    trail = [(e["action"], e["stage"], e["who"], e["reason"]) for e in
             admin(gw, "/admin/rollouts/history?tier=mid").json()["data"]]
    assert trail == [("rollback", "rolled_back", admin_id, "errors in v2"),
                     ("promote", "full", admin_id, "vip is happy"), ("start", "canary", admin_id, "vip tries it")]
    promoted = admin(gw, "/admin/rollouts/history?tier=mid").json()["data"][1]
    # an admin's change keeps each version's window as it stood: the canary's 20 + 20 answers
    assert (promoted["metrics"]["v2"]["requests"], promoted["metrics"]["v1"]["requests"]) == (20, 20)


def test_the_cli_changes_the_rollout_a_running_gateway_follows(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, _ = two_versions
    key = tenant_key(gw, "clitenant")
    where = ["--data-dir", str(gw.settings.data_dir), "--tiers", str(gw.settings.tiers_file)]
    run = CliRunner().invoke(cli, ["rollout", "start", "mid", "v2", "--share", "0", "--tenant", "clitenant",
                                   "--reason", "from the cli", *where])
    assert run.exit_code == 0, run.output
    assert "v2 over v1, canary" in run.output
    deadline = time.time() + 10  # the gateway follows the store every ROLLOUT_FOLLOW_S
    while not admin(gw, "/admin/rollouts").json()["data"] and time.time() < deadline:
        time.sleep(0.1)
    assert ask(gw, key, first_turn(1)).headers["x-tiergate-model-version"] == "v2"
    again = CliRunner().invoke(cli, ["rollout", "start", "mid", "v2", "--reason", "twice", *where])
    assert again.exit_code != 0 and "in progress" in again.output
    status = CliRunner().invoke(cli, ["rollout", "status", *where])
    assert "mid: v2 over v1, canary 0.00% + tenants clitenant; last changed by cli (from the cli)" in status.output


def test_a_cached_answer_is_never_served_from_another_version(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, new = two_versions
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # acme's plan caches
    first = ask(gw, gw.tenant_key, messages)
    assert (first.headers["x-tiergate-model-version"], first.headers["x-tiergate-cache"]) == ("v1", "miss")
    assert ask(gw, gw.tenant_key, messages).headers["x-tiergate-cache"] == "hit"
    admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "tenants": ["acme"], "reason": "acme first"})
    on_new = ask(gw, gw.tenant_key, messages)
    assert (on_new.headers["x-tiergate-model-version"], on_new.headers["x-tiergate-cache"]) == ("v2", "miss")
    assert len(new.requests) == 1  # v2's own upstream answered
    admin(gw, "/admin/rollouts/mid/rollback", {"reason": "back"})
    back = ask(gw, gw.tenant_key, messages)
    assert (back.headers["x-tiergate-model-version"], back.headers["x-tiergate-cache"]) == ("v1", "hit")


def cached_versions(gw: Gateway, expected: set[str]) -> set[str]:
    """The versions of tier mid whose answers the cache holds, once they are `expected` (within 10 s: writes and
    retirements run in the background)."""
    entries = gw.app.state.services.cache.cache.entries
    deadline = time.time() + 10
    while True:
        found = {e.model_version.rsplit("@", 1)[-1] for i in entries.ids_of_tenant(None) if (e := entries.get(i))}
        if found == expected or time.time() > deadline:
            return found
        time.sleep(0.05)


def test_a_version_no_longer_served_loses_its_cached_answers(
        two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, _ = two_versions
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # acme's plan caches
    assert ask(gw, gw.tenant_key, messages).headers["x-tiergate-cache"] == "miss"
    admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "tenants": ["acme"], "reason": "acme first"})
    assert ask(gw, gw.tenant_key, messages).headers["x-tiergate-model-version"] == "v2"
    assert cached_versions(gw, {"v1", "v2"}) == {"v1", "v2"}  # both serve during the canary
    admin(gw, "/admin/rollouts/mid/promote", {"reason": "v2 is good"})
    assert cached_versions(gw, {"v2"}) == {"v2"}  # no one is sent to v1 any more: its answers go, not at their TTL
    admin(gw, "/admin/rollouts/mid/rollback", {"reason": "back"})
    assert cached_versions(gw, set()) == set()
    back = ask(gw, gw.tenant_key, messages)  # v1's answer went with its promotion
    assert (back.headers["x-tiergate-model-version"], back.headers["x-tiergate-cache"]) == ("v1", "miss")
    assert cached_versions(gw, {"v1"}) == {"v1"}  # and v1, served again, keeps its new one
    assert ask(gw, gw.tenant_key, messages).headers["x-tiergate-cache"] == "hit"


def test_bad_admin_input_is_refused_and_changes_nothing(two_versions: tuple[Gateway, StubState, StubState]) -> None:
    gw, _, _ = two_versions
    assert admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.1, "reason": "r"}).status_code \
        == 201

    def state() -> tuple[list[dict[str, Any]], dict[str, Any]]:  # the guards' live reading aside
        return ([{k: v for k, v in r.items() if k != "guard"} for r in admin(gw, "/admin/rollouts").json()["data"]],
                admin(gw, "/admin/rollouts/history").json())

    before = state()
    forged = "drill\nrollout of v1 on tier mid: rolled_back by admin (forged)"  # was taken, and logged as it was
    refused = [
        ("/admin/rollouts", {"tier": "nope", "version": "v2", "reason": "r"}, 400, "tier", "tier_not_found"),
        ("/admin/rollouts", {"tier": "full", "version": "v2", "reason": "r"}, 400, "tier", "tier_has_no_versions"),
        ("/admin/rollouts", {"tier": "mid", "version": "v9", "reason": "r"}, 400, "version", "version_not_found"),
        ("/admin/rollouts", {"tier": "mid", "version": "v2", "share": 1.5, "reason": "r"}, 400, "share",
         "less_than_equal"),
        ("/admin/rollouts", {"tier": "mid", "version": "v2", "reason": ""}, 400, "reason", "string_too_short"),
        ("/admin/rollouts", {"tier": "mid", "version": "v2", "reason": "again"}, 409, None, "rollout_in_progress"),
        ("/admin/rollouts", {"tier": "mid", "version": "v2", "reason": forged}, 400, "reason", "invalid_value"),
        ("/admin/rollouts/mid/promote", {"reason": "r", "share": 0.05}, 400, "share", "share_lowered"),  # was null
        ("/admin/rollouts/mid/promote", {"reason": "ok\u2028forged"}, 400, "reason", "invalid_value"),
        ("/admin/rollouts/full/pause", {"reason": "r"}, 404, "tier", "tier_has_no_versions"),
        ("/admin/rollouts/mid/pause", {"reason": forged}, 400, "reason", "invalid_value"),
        ("/admin/rollouts/mid/rollback", {}, 400, "reason", "missing"),
        ("/admin/rollouts/mid/rollback", {"reason": "\t\r"}, 400, "reason", "invalid_value"),
        ("/admin/rollouts/mid/rollback", {"reason": " \u00a0 "}, 400, "reason", "reason_required"),
    ]
    for path, body, status, param, code in refused:
        r = admin(gw, path, body)
        assert r.status_code == status, (path, body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), (path, body, r.text)
    for limit in ("-5", "0", "1001", "ten"):  # -5 was read as 1
        r = admin(gw, f"/admin/rollouts/history?limit={limit}")
        assert r.status_code == 400, (limit, r.text)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("limit", "invalid_value")
    with gw.client(gw.tenant_key) as c:  # a tenant's key may not
        assert c.post("/admin/rollouts/mid/rollback", json={"reason": "r"}).status_code == 403
    assert state() == before


def test_a_dead_candidate_is_passed_over_then_rolled_back_by_its_guard(
        two_versions: tuple[Gateway, StubState, StubState], servers: list[tuple[ServerThread, StubState]]) -> None:
    gw, _, new = two_versions
    key = tenant_key(gw, "canaried")
    guards = {"max_error_rate": 0.2, "max_ttft_p95_ratio": None, "max_tpot_p95_ratio": None, "min_requests": 5,
              "window_s": 3.0, "breach_for_s": 1.0}
    r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "share": 0.9, "guards": guards,
                                      "reason": "big canary"})
    assert r.status_code == 201, r.text
    before = [ask(gw, key, first_turn(i)).headers["x-tiergate-model-version"] for i in range(20)]
    assert before.count("v2") >= 12 and len(new.requests) == before.count("v2")  # the candidate answers
    servers[1][0].stop()  # v2's upstream dies
    killed, answered, stage = time.monotonic(), [], "canary"
    while stage == "canary" and time.monotonic() - killed < 15:
        answered.append(ask(gw, key, first_turn(100 + len(answered))))  # each one a 200 (`ask` asserts it)
        stage = admin(gw, "/admin/rollouts").json()["data"][0]["stage"]
    assert stage == "rolled_back"
    assert time.monotonic() - killed < 3.0 + 1.0 + 3.0  # the window, the hysteresis, and evaluations to spare
    assert {a.headers["x-tiergate-model-version"] for a in answered} == {"v1"}  # the baseline stood in
    assert any("candidate v2 is down" in a.headers["x-tiergate-route-reason"]
               or "candidate v2 unreachable" in a.headers["x-tiergate-route-reason"] for a in answered)
    event = admin(gw, "/admin/rollouts/history?tier=mid").json()["data"][0]
    assert (event["action"], event["stage"], event["who"]) == ("rollback", "rolled_back", "guard")
    assert event["reason"].startswith("guard max_error_rate: ")
    assert event["metrics"]["v2"]["errors"] >= 1 and event["metrics"]["v2"]["error_rate"] > 0.2
    later = {ask(gw, key, first_turn(1000 + i)).headers["x-tiergate-model-version"] for i in range(20)}
    assert later == {"v1"}  # every new conversation is back on the old version
    rows = [row for row in gw.ledger_rows() if row.tenant == "canaried"]
    assert len(rows) == 20 + len(answered) + 20 and all(row.status == "ok" for row in rows)
