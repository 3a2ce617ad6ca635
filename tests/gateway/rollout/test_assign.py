"""Which version answers a conversation: deterministic, sticky without storage, and monotonic in the share."""

from __future__ import annotations

import pytest

from gateway.rollout.assign import BUCKETS, bucket, conversation_id, on_candidate, version_for
from gateway.rollout.state import Rollout, Stage


def rollout(stage: Stage = "canary", share: float = 0.2, tenants: tuple[str, ...] = (), rid: str = "r1") -> Rollout:
    return Rollout(rid, "mid", "v2", "v1", stage, share, tenants, 0.0, "k", 0.0, "k", "test", 1)


def conversations(n: int, tenant: str = "acme") -> list[str]:
    return [conversation_id(tenant, [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": f"question {i}"}]) for i in range(n)]


def test_a_later_turn_is_the_same_conversation_as_its_first() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]
    assert conversation_id("acme", first) == conversation_id("acme", later)
    assert conversation_id("acme", first) != conversation_id("other", first)  # tenants never share a conversation
    assert conversation_id("acme", first, "s-1") == conversation_id("acme", later, "s-1") != \
        conversation_id("acme", first, "s-2")  # the session header names the conversation when sent


def test_the_share_of_conversations_on_the_candidate_is_the_canary_share() -> None:
    convs = conversations(10_000)
    for share in (0.0, 0.05, 0.2, 0.5, 1.0):
        on = sum(on_candidate(rollout(share=share), "acme", c) for c in convs)
        sigma = (10_000 * share * (1 - share)) ** 0.5
        assert abs(on - 10_000 * share) <= 4 * sigma + 1, (share, on)


def test_raising_the_share_only_moves_conversations_from_old_to_new() -> None:
    convs = conversations(5_000)
    before = {c for c in convs if on_candidate(rollout(share=0.1), "acme", c)}
    after = {c for c in convs if on_candidate(rollout(share=0.3), "acme", c)}
    assert before < after
    assert len(after) > 2 * len(before)


def test_each_rollout_draws_its_own_canary() -> None:
    convs = conversations(2_000)
    a = {c for c in convs if on_candidate(rollout(rid="a"), "acme", c)}
    b = {c for c in convs if on_candidate(rollout(rid="b"), "acme", c)}
    assert a != b
    assert all(0 <= bucket(c, "a") < BUCKETS for c in convs)


def test_named_tenants_and_stages() -> None:
    convs = conversations(200, tenant="vip")
    assert all(version_for(rollout(share=0.0, tenants=("vip",)), "vip", c) == "v2" for c in convs)
    assert all(version_for(rollout(share=0.0, tenants=("vip",)), "acme", c) == "v1" for c in convs)
    assert all(version_for(rollout("full", share=0.0), "acme", c) == "v2" for c in convs)
    assert all(version_for(rollout("rolled_back", share=1.0, tenants=("vip",)), "vip", c) == "v1" for c in convs)
    paused = [version_for(rollout("paused"), "acme", c) for c in convs]
    assert paused == [version_for(rollout("canary"), "acme", c) for c in convs]  # a pause holds everyone in place


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_assignment_is_a_pure_function(share: float) -> None:
    convs = conversations(300)
    assert [on_candidate(rollout(share=share), "acme", c) for c in convs] == \
        [on_candidate(rollout(share=share), "acme", c) for c in convs]
