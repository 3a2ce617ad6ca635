"""Idempotency-Key claims on SQLite whose file is damaged, or whose memory runs out: either is `LedgerUnavailable` (a
retryable 503 at the gateway; both were 500s) with nothing claimed, logged once as an error for the operator, and a
claim that fails out of memory leaves no transaction holding the database's write lock (its rollback, short of memory
too, left it open: the ledger's writer waited on it, and every later claim failed). Faults are real: bytes of the
file overwritten, and SQLite's own heap limit (tests/quotas/test_idempotency_sql_faults.py has the others)."""

from __future__ import annotations

import _sqlite3
import asyncio
import ctypes
import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from quotas.idempotency import Claim, Running
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import LedgerUnavailable


async def damage_key_index(path: Path, keys: int = 50) -> None:
    """Records of `keys` keys in the ledger file at `path`, then their index (the table's primary key, which every
    claim reads) overwritten with garbage, as a disk or a copy gone wrong leaves it; the table's own pages are kept."""
    store = SQLiteIdempotency(path)
    for i in range(keys):
        await store.begin("acme", f"old-{i}", "body", f"r{i}", lease_s=3600)
    await store.close()  # its WAL checkpointed into the file
    with sqlite3.connect(path) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_idempotency_1'"
                            ).fetchone()[0]
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * 64)


@contextmanager
def heap_limit() -> Iterator[ctypes.CDLL]:
    """SQLite's allocator (the library the sqlite3 module links), whose hard heap limit the test sets; lifted after."""
    lib = ctypes.CDLL(_sqlite3.__file__)
    lib.sqlite3_hard_heap_limit64.restype = lib.sqlite3_memory_used.restype = ctypes.c_int64
    lib.sqlite3_hard_heap_limit64.argtypes = [ctypes.c_int64]
    if lib.sqlite3_memory_used() <= 0:
        pytest.skip("this SQLite keeps no count of its memory: its heap limit cannot be set")
    try:
        yield lib
    finally:
        lib.sqlite3_hard_heap_limit64(0)


async def test_a_damaged_file_is_unavailable_claims_nothing_and_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ledger.db"
    await damage_key_index(path)
    store = SQLiteIdempotency(path)  # it opens: what is damaged is read by a claim
    try:
        with caplog.at_level(logging.WARNING, logger="tiergate.idempotency"):
            for owner in ("r1", "r2", "r3"):  # a replay, a new key: each refused, none a bug's 500
                with pytest.raises(LedgerUnavailable, match="malformed"):
                    await store.begin("acme", "old-1" if owner == "r1" else "new", "body", owner, lease_s=60)
        (logged,) = caplog.records  # once, not once a request
        assert logged.levelno == logging.ERROR and str(path) in logged.getMessage()
        assert "damaged" in logged.getMessage()
        assert store._conn is not None and not store._conn.in_transaction
        assert store._conn.execute("SELECT count(*) FROM idempotency").fetchone() == (50,)  # nothing claimed
    finally:
        await store.close()


async def test_out_of_memory_is_unavailable_and_leaves_no_write_lock(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteIdempotency(path)
    try:
        with heap_limit() as lib:
            def short_of_memory(action: int, table: str | None, *_: object) -> int:
                """SQLite's memory runs out as it prepares the claim's insert (once), inside its transaction: the
                rollback after is prepared short of memory too."""
                if action == sqlite3.SQLITE_INSERT and table == "idempotency" and not ran_out:
                    ran_out.append(lib.sqlite3_hard_heap_limit64(lib.sqlite3_memory_used()))
                return sqlite3.SQLITE_OK

            ran_out: list[int] = []

            assert store._conn is not None
            store._conn.set_authorizer(short_of_memory)
            with caplog.at_level(logging.WARNING, logger="tiergate.idempotency"), \
                    pytest.raises(LedgerUnavailable, match="out of memory"):
                await store.begin("acme", "k1", "body", "r1", lease_s=60)
        assert ran_out
        (logged,) = caplog.records
        assert logged.levelno == logging.ERROR and "out of memory" in logged.getMessage()
        writer = sqlite3.connect(path, timeout=0.1, isolation_level=None)  # the ledger's writer is not locked out
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("ROLLBACK")
        writer.close()
        assert await store.begin("acme", "k1", "body", "r2", lease_s=60) == Claim("acme", "k1", "body", "r2")
        assert store._conn is not None
        assert store._conn.execute("SELECT key, owner FROM idempotency").fetchall() == [("k1", "r2")]
    finally:
        await store.close()


async def test_a_give_up_sqlite_cannot_take_now_is_owed_not_left_to_the_lease(tmp_path: Path) -> None:
    """A request that failed gives its claim up; SQLite busy past its timeout then (another writer holds the lock) must
    not leave the claim running for its lease, every retry told 409 meanwhile: it is given up once SQLite can take it,
    as PostgreSQL's and Redis's give-ups are, and the retry runs."""
    path = tmp_path / "ledger.db"
    store = SQLiteIdempotency(path)
    try:
        claim = await store.begin("acme", "k", "body", "r1", lease_s=600)
        assert isinstance(claim, Claim)
        assert store._conn is not None
        store._conn.execute("PRAGMA busy_timeout = 50")  # its 5 s, shorter
        writer = sqlite3.connect(path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # the write lock held past the give-up's timeout
        try:
            await store.abandon(claim)  # no error on top of the request's own
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        deadline = time.monotonic() + 10
        while not isinstance(begun := await store.begin("acme", "k", "body", "r2", lease_s=600), Claim):
            assert begun == Running() and time.monotonic() < deadline, "the failed request's claim is still held"
            await asyncio.sleep(0.05)
    finally:
        await store.close()
