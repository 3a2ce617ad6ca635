"""StaleVersions on a real SQLite store: which entries a bump or a retirement lets `reclaim` delete."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cache.sqlite_store import SQLiteStore
from cache.stale_versions import StaleVersions
from cache.store import Entry


def _entry(i: int, *, tenant: str = "acme", data: str = "1", model: str = "m", created_at: float = 10.0,
           expires_at: float | None = None) -> Entry:
    return Entry(entry_id=f"e{i}", scope_id=f"{tenant}:{data}:{model}", tenant=tenant, data_version=data,
                 model_version=model, exact_key=f"k{i}", partition="p", semantic_text=f"question {i}",
                 response=f"answer {i}", usage={}, created_at=created_at, expires_at=expires_at,
                 last_used=created_at, embedding=np.ones(4, dtype=np.float32))


def test_a_bump_names_older_entries_of_that_tenant_only_and_ends_when_none_are_left() -> None:
    store, stale = SQLiteStore(), StaleVersions()
    for e in (_entry(1), _entry(2, data="2", created_at=30.0), _entry(3, tenant="globex"), _entry(4, data="0")):
        store.put(e)
    stale.bump_data("acme", "2", bumped_at=20.0)
    assert sorted(stale.to_reclaim(store, now=25.0, limit=10)) == ["e1", "e4"]
    store.delete(["e1", "e4"])
    assert stale.to_reclaim(store, now=25.0, limit=10) == []
    store.put(_entry(5, created_at=15.0))  # a write that lands after the rule is gone is not named again
    assert stale.to_reclaim(store, now=25.0, limit=10) == []


def test_a_late_write_from_replaced_data_is_recognised() -> None:
    stale = StaleVersions()
    stale.bump_data("acme", "2", bumped_at=20.0)
    assert stale.written_too_late(_entry(1, created_at=19.0))
    assert not stale.written_too_late(_entry(1, created_at=21.0))  # created after the bump: kept
    assert not stale.written_too_late(_entry(1, data="2", created_at=19.0))  # the current version
    assert not stale.written_too_late(replace(_entry(1, created_at=19.0), tenant="globex"))


def test_a_retired_model_is_reclaimed_until_none_is_left_and_served_again_is_kept() -> None:
    store, stale = SQLiteStore(), StaleVersions()
    store.put(_entry(1, model="old"))
    stale.retire_model("old")
    assert stale.written_too_late(_entry(2, model="old"))  # a late answer of it is not written
    assert stale.to_reclaim(store, now=10.0, limit=10) == ["e1"]
    store.delete(["e1"])
    assert stale.to_reclaim(store, now=10.0, limit=10) == []
    store.put(_entry(3, model="old"))  # the store is no longer scanned for it once none was left
    assert stale.to_reclaim(store, now=10.0, limit=10) == []
    stale.retire_model("again")
    stale.serve_model("again")  # rolled back to: its answers are kept
    store.put(_entry(4, model="again"))
    assert not stale.written_too_late(_entry(4, model="again"))
    assert stale.to_reclaim(store, now=10.0, limit=10) == []


def test_expired_come_first_then_retired_models_within_the_limit() -> None:
    store, stale = SQLiteStore(), StaleVersions()
    store.put(_entry(1, expires_at=5.0))
    for i in range(2, 6):
        store.put(_entry(i, model="old"))
    store.put(_entry(6))
    stale.retire_model("old")
    first = stale.to_reclaim(store, now=10.0, limit=3)
    assert first[0] == "e1" and len(first) == 3 and set(first[1:]) <= {"e2", "e3", "e4", "e5"}
    assert "e6" not in stale.to_reclaim(store, now=10.0, limit=100)
