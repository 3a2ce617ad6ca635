"""Both stores (SQLite and a real redis-server): one tenant's byte budget (`max_bytes_per_tenant`), which a tenant of
long answers fills long before its count bound, and which it enforces by evicting only its own entries."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from cache import CacheStore, Entry, RedisStore, SQLiteStore
from cache.store import stored_bytes

MakeStore = Callable[..., CacheStore]
ANSWER = 10_000  # characters of each long answer


@pytest.fixture(params=["sqlite", "sqlite_file", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[MakeStore]:
    made: list[CacheStore] = []

    def make(**bounds: int | None) -> CacheStore:
        if request.param.startswith("sqlite"):
            path = ":memory:" if request.param == "sqlite" else request.getfixturevalue("tmp_path") / f"{len(made)}.db"
            store: CacheStore = SQLiteStore(path, **bounds)  # type: ignore[arg-type]
        else:
            store = RedisStore(request.getfixturevalue("redis_url"), **bounds)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def eid(i: int) -> str:
    return f"e{i:03d}"


def entry(i: int, *, tenant: str = "acme", answer: int = 10, last_used: float | None = None) -> Entry:
    """Entries of one size for one answer length (ids of three digits)."""
    return Entry(entry_id=eid(i), scope_id=f"s:{tenant}", tenant=tenant, data_version="1", model_version="m",
                 exact_key=f"k{i:03d}", partition="p", semantic_text=f"question {i:03d}", response="é" * answer,
                 usage={"total_tokens": 7}, created_at=1.0, last_used=float(i) if last_used is None else last_used,
                 embedding=np.full(4, i, dtype=np.float32))


def held(store: CacheStore, tenant: str) -> int:
    """The bytes the tenant's entries hold in the store, measured from what it returns."""
    return sum(stored_bytes(e) for i in store.ids_of_tenant(tenant) if (e := store.get(i)) is not None)


def test_a_tenant_over_its_byte_budget_evicts_only_its_own_oldest(make_store: MakeStore) -> None:
    size = stored_bytes(entry(1, answer=ANSWER))
    store = make_store(max_entries=1000, max_entries_per_tenant=1000, max_bytes_per_tenant=5 * size)
    small = [entry(100 + i, tenant="globex", last_used=0.0) for i in range(3)]  # the oldest entries of all
    for e in small:
        store.put(e)
    displaced: list[str] = []
    for i in range(1, 21):  # acme's long answers: far fewer than its count bound
        displaced += store.put(entry(i, answer=ANSWER)) or []
    assert sorted(displaced) == sorted(eid(i) for i in range(1, 16))  # its own fifteen oldest, in order
    assert sorted(store.ids_of_tenant("acme")) == sorted(eid(i) for i in range(16, 21))
    assert held(store, "acme") <= 5 * size
    assert sorted(store.ids_of_tenant("globex")) == sorted(e.entry_id for e in small)  # untouched


def test_the_budget_counts_sizes_freed_by_deletes_and_replacements(make_store: MakeStore) -> None:
    size = stored_bytes(entry(1, answer=ANSWER))
    store = make_store(max_entries=1000, max_bytes_per_tenant=3 * size)
    for i in range(1, 4):
        store.put(entry(i, answer=ANSWER))
    store.delete([eid(1)])
    replaced = entry(4, answer=ANSWER)
    replaced.exact_key = "k002"  # replaces e2: its bytes are freed, not counted twice
    assert store.put(replaced) == [eid(2)]
    assert store.put(entry(5, answer=ANSWER)) == []  # e3, e4, e5 fit exactly
    assert store.put(entry(6, answer=ANSWER)) == [eid(3)]
    assert held(store, "acme") <= 3 * size


def test_an_entry_larger_than_the_whole_budget_is_not_written(make_store: MakeStore) -> None:
    store = make_store(max_bytes_per_tenant=4 * stored_bytes(entry(1)))
    for i in range(1, 4):
        store.put(entry(i))
    assert store.put(entry(9, answer=ANSWER)) is None
    assert store.get(eid(9)) is None and sorted(store.ids_of_tenant("acme")) == [eid(1), eid(2), eid(3)]


def _file_from_before(path: Path, entries: int) -> None:
    """A cache file of `entries` long answers, written before sizes were stored."""
    old = SQLiteStore(path, max_bytes_per_tenant=None)
    for i in range(1, entries + 1):
        old.put(entry(i, answer=ANSWER))
    old.close()
    db = sqlite3.connect(path)  # the schema as it was: no sizes, triggers that count entries only
    db.executescript("""
        DROP TRIGGER entries_put; DROP TRIGGER entries_del;
        ALTER TABLE entries DROP COLUMN size; ALTER TABLE tenant_sizes DROP COLUMN bytes;
        CREATE TRIGGER entries_put AFTER INSERT ON entries BEGIN
            INSERT INTO tenant_sizes (tenant, n) VALUES (NEW.tenant, 1) ON CONFLICT (tenant) DO UPDATE SET n = n + 1;
            UPDATE entry_count SET n = n + 1;
        END;
        CREATE TRIGGER entries_del AFTER DELETE ON entries BEGIN
            UPDATE tenant_sizes SET n = n - 1 WHERE tenant = OLD.tenant;
            UPDATE entry_count SET n = n - 1;
        END;""")
    db.close()


def test_a_file_from_before_the_budget_counts_its_entries(tmp_path: Path) -> None:
    """A cache file written before sizes were stored: its rows are measured on open, and count from then on."""
    path = tmp_path / "cache.sqlite3"
    size = stored_bytes(entry(1, answer=ANSWER))
    _file_from_before(path, 4)
    store = SQLiteStore(path, max_bytes_per_tenant=3 * size)
    assert store.put(entry(5, answer=ANSWER)) == [eid(1), eid(2)]
    assert sorted(store.ids_of_tenant("acme")) == [eid(3), eid(4), eid(5)]
    store.close()


def test_a_write_by_a_gateway_of_before_while_the_file_is_measured_is_counted(tmp_path: Path) -> None:
    """Measuring a file from before replaces its triggers in one transaction: a gateway of before, still running on
    the file, writes just after it (before the schema's statements ran, its triggers were dropped then)."""
    path = tmp_path / "cache.sqlite3"
    _file_from_before(path, 2)

    class Opening(SQLiteStore):
        def _add_sizes(self) -> None:
            super()._add_sizes()
            other = sqlite3.connect(path)  # the old gateway's insert: no size column in it
            other.execute("INSERT INTO entries (entry_id, scope_id, tenant, data_version, model_version, exact_key, "
                          "partition, semantic_text, response, usage, metadata, created_at, expires_at, last_used, "
                          "embedding) VALUES ('e009', 's:acme', 'acme', '1', 'm', 'k009', 'p', 'q', 'a', '{}', '{}', "
                          "1.0, NULL, 9.0, x'00000000')")
            other.commit()
            other.close()

    store = Opening(path)
    try:
        assert len(store) == 3  # the entry count and the tenant's follow the insert
        assert store.changes_since("")[1][-1] == ("put", "e009", "p")  # and other processes' indexes see it
    finally:
        store.close()
