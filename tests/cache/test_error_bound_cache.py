"""The error bound inside the cache (real MiniLM): a candidate below the learned threshold is kept with the miss
and labelled by the tier's fresh answer; a tenant whose near misses keep proving wrong loses its semantic hits,
another tenant keeps its own; a sampled hit is marked for a shadow check and its label is weighted."""

from __future__ import annotations

import pytest

from cache import Hit, Miss, SemanticCache, TenantPolicy
from cache.error_bound import MIN_LABELS, NEVER
from tests.cache.conftest import chat, scope

STORED, PARA = "How do I reset my password?", "How can I reset my password?"


def remember(cache: SemanticCache, tenant: str) -> None:
    body = chat(STORED)
    cache.store(scope(body, tenant=tenant), body, "Click 'Forgot password' on the sign-in page.")


def test_a_near_miss_is_labelled_and_wrong_answers_take_the_semantic_hits_away(cache: SemanticCache) -> None:
    remember(cache, "acme")
    remember(cache, "globex")
    para = chat(PARA)
    strict = TenantPolicy(similarity_threshold=0.999, max_error_rate=0.01)  # the paraphrase is a near miss
    near = cache.lookup(scope(para), para, policy=strict)
    assert isinstance(near, Miss) and near.near is not None and near.near.tenant == "acme"
    assert cache.label(near, strict, "Click 'Forgot password' on the sign-in page.") is True
    assert cache.label(near, strict, "Call support.") is False

    loose = TenantPolicy(similarity_threshold=0.8, max_error_rate=0.01)
    assert isinstance(cache.lookup(scope(para), para, policy=loose), Hit)  # the static threshold decides at first
    for _ in range(MIN_LABELS):  # the tier keeps answering something else than the cached answer
        miss = cache.lookup(scope(para), para, policy=strict)
        cache.label(miss, loose, "Call support.")
    assert cache.bounds.states()["acme"].threshold == NEVER
    assert isinstance(cache.lookup(scope(para), para, policy=loose), Miss)  # no semantic hit for acme now ...
    exact = chat(STORED)
    assert isinstance(cache.lookup(scope(exact), exact, policy=loose), Hit)  # ... exact ones still
    other = scope(para, tenant="globex")
    assert isinstance(cache.lookup(other, para, policy=loose), Hit)  # and another tenant's bound is its own


def test_without_a_bound_nothing_is_kept_to_label(cache: SemanticCache) -> None:
    remember(cache, "acme")
    para = chat(PARA)
    policy = TenantPolicy(similarity_threshold=0.999)
    miss = cache.lookup(scope(para), para, policy=policy)
    assert isinstance(miss, Miss) and miss.near is None and cache.label(miss, policy, "x") is None


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_a_sampled_hit_is_marked_for_its_shadow_check(cache: SemanticCache, rate: float) -> None:
    remember(cache, "acme")
    para = chat(PARA)
    policy = TenantPolicy(similarity_threshold=0.8, max_error_rate=0.01, shadow_rate=rate)
    hit = cache.lookup(scope(para), para, policy=policy)
    assert isinstance(hit, Hit) and hit.shadow_rate == rate
    if rate:
        assert cache.label(hit, policy, "Click 'Forgot password' on the sign-in page.") is True
        state = cache.bounds.states()["acme"]
        assert state.checked_hits == 1 and state.estimated_error == 0.0
    else:
        assert cache.label(hit, policy, "anything") is None
