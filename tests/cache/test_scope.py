"""Scope ids: equal for equal scopes, different when any field differs."""

from __future__ import annotations

from cache import CacheScope, identity_snapshot
from tests.cache.conftest import chat, scope


def test_scope_id_is_stable_and_order_free_in_roles() -> None:
    a = scope(roles=["reader", "billing"])
    b = scope(roles=["billing", "reader", "reader"])
    assert a.scope_id == b.scope_id
    assert len(a.scope_id) == 32


def test_every_field_changes_the_scope_id() -> None:
    base = scope()
    variants = [
        scope(tenant="globex"),
        scope(roles=["admin"]),
        scope(end_user="u1"),
        scope(data_version=2),
        scope(data_version="1"),  # a str version is not the int version
        scope(model_version="m2"),
        scope(chat("x", system="You are a pirate.")),
        scope(chat("x", temperature=0.5, seed=7)),
        scope(chat("x", max_tokens=5)),
        scope(chat("x", presence_penalty=0.5)),
        scope(chat("x", frequency_penalty=0.5)),
        scope(chat("x", frequency_penalty=-0.5)),
        scope(chat("x", presence_penalty=0.5, frequency_penalty=0.5)),
    ]
    ids = {v.scope_id for v in variants}
    assert base.scope_id not in ids
    assert len(ids) == len(variants)


def test_identity_snapshot_includes_end_user_only_when_given() -> None:
    assert identity_snapshot(["a"]) == "roles=a"
    assert identity_snapshot(["b", "a"], "u1") == "roles=a,b;user=u1"


def test_fields_cannot_collide_by_concatenation() -> None:
    a = CacheScope("ab", "c", 1, "m", "h", "greedy")
    b = CacheScope("a", "bc", 1, "m", "h", "greedy")
    assert a.scope_id != b.scope_id
