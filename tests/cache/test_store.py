"""Both stores (SQLite and a real redis-server): LRU bound, exact lookup, selections; SQLite across reopen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cache import CacheStore, Entry, RedisStore, SQLiteStore

MakeStore = Callable[..., CacheStore]


@pytest.fixture(params=["sqlite", "sqlite_file", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[MakeStore]:
    made: list[CacheStore] = []

    def make(max_entries: int = 100, max_entries_per_tenant: int | None = None) -> CacheStore:
        if request.param.startswith("sqlite"):  # a file's reads go through other connections than its writes
            path = ":memory:" if request.param == "sqlite" else request.getfixturevalue("tmp_path") / f"{len(made)}.db"
            store: CacheStore = SQLiteStore(path, max_entries=max_entries,
                                            max_entries_per_tenant=max_entries_per_tenant)
        else:
            store = RedisStore(request.getfixturevalue("redis_url"), max_entries=max_entries,
                               max_entries_per_tenant=max_entries_per_tenant)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def entry(i: int, *, tenant: str = "acme", last_used: float = 0.0, vector: bool = True) -> Entry:
    return Entry(entry_id=f"e{i}", scope_id="s", tenant=tenant, data_version="1", model_version="m",
                 exact_key=f"k{i}", partition="s:h", semantic_text=f"question {i}", response=f"answer {i}",
                 usage={"total_tokens": i}, created_at=1.0, expires_at=None, last_used=last_used,
                 embedding=np.full(4, i, dtype=np.float32) if vector else None)


def test_put_get_and_find_exact(make_store: MakeStore) -> None:
    store = make_store()
    assert store.put(entry(1)) == []
    got = store.find_exact("s", "k1")
    assert got is not None and got.response == "answer 1" and got.usage == {"total_tokens": 1}
    assert np.array_equal(got.embedding, np.full(4, 1, dtype=np.float32))
    assert store.find_exact("other-scope", "k1") is None
    assert store.get("e1").metadata == {} and store.get("missing") is None


def test_same_exact_key_replaces(make_store: MakeStore) -> None:
    store = make_store()
    store.put(entry(1))
    newer = entry(2)
    newer.exact_key = "k1"
    assert store.put(newer) == ["e1"]
    assert len(store) == 1 and store.find_exact("s", "k1").entry_id == "e2"


def test_least_recently_used_is_evicted_at_the_bound(make_store: MakeStore) -> None:
    store = make_store(max_entries=3)
    for i in range(3):
        store.put(entry(i, last_used=float(i)))
    store.touch("e0", 10.0)  # e0 is now the most recently used
    assert store.put(entry(3, last_used=11.0)) == ["e1"]
    assert len(store) == 3
    assert store.get("e1") is None and store.get("e0") is not None


def test_model_versions_of_every_entry(make_store: MakeStore) -> None:
    store = make_store()
    assert store.model_versions() == set()
    for i, version in enumerate(("m", "m", "m2")):
        store.put(replace(entry(i), model_version=version))
    assert store.model_versions() == {"m", "m2"}


def test_a_tenant_over_its_own_bound_evicts_only_its_own_entries(make_store: MakeStore) -> None:
    store = make_store(max_entries=100, max_entries_per_tenant=3)
    store.put(entry(0, tenant="globex", last_used=0.0))  # the oldest entry of all
    displaced = []
    for i in range(1, 11):  # acme floods
        displaced += store.put(entry(i, tenant="acme", last_used=float(i)))
    assert sorted(displaced) == sorted(f"e{i}" for i in range(1, 8))  # acme's own seven oldest
    assert store.get("e0") is not None and sorted(store.ids_of_tenant("acme")) == ["e10", "e8", "e9"]


def test_over_the_store_bound_the_largest_tenant_loses_entries(make_store: MakeStore) -> None:
    store = make_store(max_entries=6)
    for i in range(3):
        store.put(entry(i, tenant="globex", last_used=float(i)))  # globex's entries are the least recently used
    for i in range(3, 20):
        store.put(entry(i, tenant="acme", last_used=float(i)))
    assert len(store) == 6
    assert sorted(store.ids_of_tenant("globex")) == ["e0", "e1", "e2"]  # the flood evicted only acme's
    assert sorted(store.ids_of_tenant("acme")) == ["e17", "e18", "e19"]


def test_processes_sharing_a_file_see_each_others_writes_and_deletes(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite3"
    gateway, cli = SQLiteStore(path), SQLiteStore(path)
    cursor = gateway.change_cursor()
    cli.put(entry(1))
    cli.put(entry(2, vector=False))  # exact-only: no vector for an index to follow
    cursor, changes = gateway.changes_since(cursor)
    assert changes == [("put", "e1", "s:h")]
    assert sorted(cli.drop_data_versions("acme", "2", created_before=5.0)) == ["e1", "e2"]
    cursor, changes = gateway.changes_since(cursor)
    assert sorted(changes) == [("del", "e1", "s:h"), ("del", "e2", "s:h")] and len(gateway) == 0
    assert gateway.changes_since(cursor) == (cursor, [])
    gateway.close()
    cli.close()


def test_a_reader_behind_a_trimmed_change_log_is_told_to_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cache.sqlite_store.MAX_CHANGES", 10)
    store = SQLiteStore()
    cursor = store.change_cursor()
    for i in range(1100):  # the log is trimmed every 1,024 writes
        store.put(entry(i))
    assert store.changes_since(cursor)[1] == [("reset", "", "")]
    store.close()


def test_a_file_from_before_the_counts_is_counted_on_open(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite3"
    old = SQLiteStore(path)
    for i in range(3):
        old.put(entry(i, tenant="acme" if i else "globex"))
    old._db.executescript("DROP TRIGGER entries_put; DROP TRIGGER entries_del; DROP TABLE tenant_sizes; "
                          "DROP TABLE entry_count; DROP TABLE changes;")  # as an older Tiergate left it
    old.close()
    store = SQLiteStore(path, max_entries=100, max_entries_per_tenant=2)
    assert len(store) == 3
    assert store.put(entry(9, tenant="acme", last_used=1.0)) == ["e1"]  # acme had two: its oldest goes
    store.close()


def test_entries_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "cache.sqlite3"
    store = SQLiteStore(path)
    store.put(entry(1))
    store.put(entry(2, vector=False))
    store.close()
    reopened = SQLiteStore(path)
    assert len(reopened) == 2
    assert reopened.get("e2").response == "answer 2"
    assert [(e, p) for e, p, _ in reopened.vectors()] == [("e1", "s:h")]


def test_select_and_delete_by_tenant(make_store: MakeStore) -> None:
    store = make_store()
    store.put(entry(1, tenant="acme"))
    store.put(entry(2, tenant="globex"))
    ids = store.ids_of_tenant("acme")
    assert ids == ["e1"]
    assert store.delete([*ids, "nope"]) == ["e1"]
    assert len(store) == 1


def test_version_selections(make_store: MakeStore) -> None:
    store = make_store()
    old, new, other_model = entry(1), entry(2), entry(3)
    new.data_version = "2"
    other_model.model_version = "m-old"
    for e in (old, new, other_model):
        store.put(e)
    assert sorted(store.ids_not_at_data_version("acme", "2", 5.0, 10)) == ["e1", "e3"]  # created at 1.0
    assert store.ids_not_at_data_version("acme", "2", 1.0, 10) == []  # created at the bump or after: kept
    assert store.ids_of_model_version("m-old", 10) == ["e3"]
    assert sorted(store.ids_of_tenant(None)) == ["e1", "e2", "e3"]
    assert sorted(store.drop_data_versions("acme", "2", 5.0)) == ["e1", "e3"]  # a bump's deletion
    assert store.ids_of_tenant("acme") == ["e2"]


def test_expired_selection(make_store: MakeStore) -> None:
    store = make_store()
    short, forever = entry(1), entry(2)
    short.expires_at = 100.0
    store.put(short)
    store.put(forever)
    assert store.expired(99.0) == [] and store.expired(100.0) == ["e1"]


def test_a_data_version_bump_refuses_answers_made_before_it_from_any_process(make_store: MakeStore) -> None:
    """Another process's answer from the replaced data, still being written when the bump deleted the old entries
    (its own process never heard of the bump), must not land after the deletion."""
    store = make_store()
    store.put(entry(1))  # data version 1, made at 1.0
    assert store.drop_data_versions("acme", "2", created_before=5.0) == ["e1"]
    late = entry(2)  # made at 1.0 at version 1, written now
    assert store.put(late) is None
    assert store.get("e2") is None and store.find_exact("s", "k2") is None and len(store) == 0
    current = replace(entry(3), data_version="2")
    assert store.put(current) == []  # the current version, whenever made
    after = replace(entry(4), data_version="1", created_at=6.0)  # made after the bump (a header's version): kept
    assert store.put(after) == []
    assert store.put(replace(entry(5), tenant="globex")) == []  # another tenant's: no bump of its own
    assert sorted(store.ids_of_tenant(None)) == ["e3", "e4", "e5"]
