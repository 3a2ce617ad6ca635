"""A file-backed SQLiteStore's reads never wait for a write in progress (one tenant's puts and their evictions
must not stall another tenant's lookups), and still see every write committed before they start."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache import Entry, SQLiteStore

WAIT_S = 10.0  # generous: a read that works returns at once; one that waits for the writer never does
HOLD_S = 60.0  # a held write outlasts any wait for it (each test releases it as soon as it is done)


def entry(i: int, *, tenant: str = "a", last_used: float = 0.0) -> Entry:
    return Entry(entry_id=f"{tenant}{i}", scope_id=f"scope-{tenant}", tenant=tenant, data_version="1",
                 model_version="m", exact_key=f"k{i}", partition=f"scope-{tenant}:h", semantic_text=f"question {i}",
                 response=f"answer {i}", created_at=1.0, last_used=last_used,
                 embedding=np.full(4, i, dtype=np.float32))


class HeldStore(SQLiteStore):
    """A store whose next put stops mid-transaction (inserted, not yet evicted or committed) until released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False
        self.held = threading.Event()
        self.release = threading.Event()

    def _evict_locked(self, entry: Entry) -> list[str]:
        if self.hold:
            self.hold = False
            self.held.set()
            assert self.release.wait(HOLD_S)
        return super()._evict_locked(entry)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[HeldStore, threading.Thread, list[list[str]]]]:
    """Tenant b has an entry; tenant a, at its bound, is in the middle of a put that evicts one of its own."""
    store = HeldStore(tmp_path / "cache.db", max_entries=100, max_entries_per_tenant=2)
    store.put(entry(1, tenant="b", last_used=5.0))
    store.put(entry(1, last_used=1.0))
    store.put(entry(2, last_used=2.0))
    store.hold = True
    displaced: list[list[str]] = []
    writer = threading.Thread(target=lambda: displaced.append(store.put(entry(3, last_used=3.0))), daemon=True)
    writer.start()
    assert store.held.wait(WAIT_S)
    try:
        yield store, writer, displaced
    finally:
        store.release.set()
        writer.join(WAIT_S)
        store.close()


def returns_while_held(call: Callable[[], Any]) -> Any:
    """`call`'s result, run in another thread; fails if it does not return while the write is held open."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # raised below, in the test's thread
            out.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive(), "the read waited for another tenant's write transaction"
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def test_a_lookups_reads_return_while_another_tenants_put_is_mid_transaction(held: Any) -> None:
    store, writer, displaced = held
    cursor = "0"
    found = returns_while_held(lambda: store.find_exact("scope-b", "k1"))
    assert found is not None and found.response == "answer 1"
    assert returns_while_held(lambda: store.get("b1")) is not None
    assert returns_while_held(lambda: store.find_exact("scope-a", "k3")) is None  # not committed yet
    _, changes = returns_while_held(lambda: store.changes_since(cursor))
    assert [c[1] for c in changes] == ["b1", "a1", "a2"]  # the held put's rows are not visible yet
    assert returns_while_held(lambda: len(store)) == 3
    returns_while_held(lambda: store.touch("b1", 9.0))  # a hit's LRU mark does not wait either
    store.release.set()
    writer.join(WAIT_S)
    assert displaced == [["a1"]]
    # read your own writes: a read on another connection, started after the commit, sees it
    assert store.find_exact("scope-a", "k3") is not None
    assert store.find_exact("scope-a", "k1") is None
    assert [c[:2] for c in store.changes_since(cursor)[1]][3:] == [("put", "a3"), ("del", "a1")]
    b1 = store.get("b1")
    assert b1 is not None and b1.last_used == 9.0  # the mark kept during the write was written by it


def test_a_mark_kept_during_a_write_orders_later_evictions(held: Any) -> None:
    store, writer, displaced = held
    returns_while_held(lambda: store.touch("a2", 10.0))  # a2 is now a's most recently used
    store.release.set()
    writer.join(WAIT_S)
    assert displaced == [["a1"]]
    assert store.put(entry(4, last_used=6.0)) == ["a3"]  # not a2: its kept mark was written


def test_a_touch_does_not_wait_for_another_process_writing_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cache.db"
    gateway = SQLiteStore(path)
    cli = HeldStore(path)
    try:
        gateway.put(entry(1, tenant="b"))
        cli.hold = True
        writer = threading.Thread(target=lambda: cli.put(entry(1)), daemon=True)
        writer.start()
        assert cli.held.wait(WAIT_S)
        try:
            assert returns_while_held(lambda: gateway.find_exact("scope-b", "k1")) is not None
            returns_while_held(lambda: gateway.touch("b1", 7.0))  # kept: the other process holds the file's lock
        finally:
            cli.release.set()
            writer.join(WAIT_S)
        gateway.put(entry(2, tenant="b"))  # the next write writes the kept mark
        b1 = cli.get("b1")
        assert b1 is not None and b1.last_used == 7.0
        assert gateway.find_exact("scope-a", "k1") is not None  # the other process's write, once committed
    finally:
        gateway.close()
        cli.close()


def test_a_read_sees_a_put_as_soon_as_it_returns_from_many_threads(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "cache.db", max_entries=1000, max_entries_per_tenant=10)
    errors: list[str] = []

    def tenant(name: str) -> None:
        for i in range(60):
            store.put(entry(i, tenant=name, last_used=float(i)))
            found = store.find_exact(f"scope-{name}", f"k{i}")
            if found is None or found.entry_id != f"{name}{i}":
                errors.append(f"{name}{i}")

    threads = [threading.Thread(target=tenant, args=(name,)) for name in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store.close()
    assert errors == []
