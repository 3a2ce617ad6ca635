"""Workers sharing the ladder's state save it by compare-and-set on its version: a save made from a state read before
another worker's save writes nothing, and the change is made again on the state read anew. Each save wrote the whole
state read before: a reload's ladder identity saved between another worker's read and its save was written over (the
other workers kept the old ladder, the reloading one counted itself out of sync), and so was an override set between
another worker's tick's read and its save (answered 200, lost). Driven: another worker's change runs right after a
worker's read of the shared state (SQLite, Redis, PostgreSQL). A state kept before the version is at version 0."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
import redis

from gateway.errors import Unavailable
from gateway.ladder.controller import TRIES, LadderController
from gateway.ladder.state import (
    COMPONENT,
    MIGRATIONS,
    LadderState,
    LadderStore,
    PostgresLadderStore,
    RedisLadderStore,
    SqliteLadderStore,
)
from quotas.fleet_db import migrate
from tests.gateway.ladder.test_controller import LADDER, Clock
from tests.gateway.ladder.test_reload_shared import FIVE, TIERS, Stores, shared, worker  # noqa: F401 (a fixture)


def after_its_reads(c: LadderController, other: Callable[[], None], times: int = 1) -> None:
    """`other` (another worker's change) runs right after each of `c`'s next `times` reads of the shared state, before
    `c` saves what it made of the state read."""
    real = c.store.load
    left = [times]

    def load() -> LadderState:
        state = real()
        if left[0] > 0:
            left[0] -= 1
            other()
        return state

    c.store.load = load  # type: ignore[method-assign]


def test_a_reload_saved_between_a_workers_read_and_its_save_is_kept_and_followed(tmp_path: Path,
                                                                                  shared: Stores) -> None:  # noqa: F811
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    a, b, c = worker(f, shared("a")), worker(f, shared("b")), worker(f, shared("c"))
    a.reload(f, TIERS)  # the shared state names a ladder: this one
    f.write_text(FIVE)
    after_its_reads(b, lambda: a.reload(f, TIERS))
    b.set_manual(2, reason="incident", who="k2")
    state = a.store.load()
    assert state.ladder_sha256 == a.ladder.sha256 and a.ladder.top == 4  # the reload's identity kept
    assert (state.manual_level, state.manual_by, state.manual_reason) == (2, "k2", "incident")  # B's change on top
    assert b.ladder.top == 4 and b.status()["ladder"]["in_sync"] is True and (b.level, b.source) == (2, "manual")
    a.tick()
    c.tick()
    assert a.status()["ladder"]["in_sync"] is True and a.level == 2
    assert c.ladder.top == 4 and c.status()["ladder"] == a.status()["ladder"] and c.status()["name"] == "protect"


def test_an_override_set_between_a_ticks_read_and_its_save_is_kept(tmp_path: Path, shared: Stores) -> None:  # noqa: F811
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    a, b = worker(f, shared("a")), worker(f, shared("b"), clock)
    for _ in range(10):  # queue waits above level 1's threshold: its 10 s are met at the next tick
        clock.t += 1
        b.signals.queue_wait(3.0)
        b.tick()
    assert b.store.load().auto_level == 0
    clock.t += 1
    b.signals.queue_wait(3.0)
    after_its_reads(b, lambda: a.set_manual(2, reason="incident", who="k1", ttl_s=600))
    b.tick()
    state = a.store.load()
    assert (state.manual_level, state.manual_by, state.manual_reason) == (2, "k1", "incident")  # the override kept
    assert state.auto_level == 1 and (b.level, b.source) == (2, "manual")  # and the triggers' level raised under it
    assert sorted(e.who for e in b.store.history()) == ["auto", "k1"]  # each change's event, once


def test_a_change_beaten_at_every_try_is_a_503_and_a_tick_is_skipped(tmp_path: Path, shared: Stores,  # noqa: F811
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Other workers' saves between each of a worker's reads and its save, every time: on-call's change answers 503
    with nothing changed (it was written over theirs); the tick gives up, says so, and the next one makes its change."""
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    a, b = worker(f, shared("a")), worker(f, shared("b"), clock)
    n = [0]

    def other() -> None:
        n[0] += 1
        a.set_manual(1, reason=f"other {n[0]}", who="k1", ttl_s=1.0)

    after_its_reads(b, other, times=TRIES)
    with pytest.raises(Unavailable) as refused:
        b.set_manual(2, reason="mine", who="k2")
    assert refused.value.status_code == 503 and refused.value.code == "ladder_state_conflict"
    assert b.store.load().manual_reason == f"other {TRIES}" and b.level == 0
    clock.t += 100  # the others' overrides (1 s, by their clock) have ended, by this worker's: its tick expires them
    after_its_reads(b, other, times=TRIES)
    with caplog.at_level("WARNING", logger="tiergate.ladder"):
        b.tick()
    assert b.store.load().manual_reason == f"other {2 * TRIES}"
    assert [r.getMessage() for r in caplog.records if "tick skipped" in r.getMessage()] != []
    b.tick()
    assert b.store.load().manual_level is None and (b.level, b.source) == (0, "auto")


OLD = {"auto_level": 1, "auto_since": 5.0, "manual_level": 2, "manual_until": None, "manual_by": "k1",
       "manual_reason": "incident"}


def saved_on_from_0(store: LadderStore) -> None:
    """`store` holds OLD as the version before wrote it: read at version 0, a change saved on it (version 1), and a
    save from the state read before refused, the change kept."""
    state = store.load()
    assert state == LadderState(**OLD) and state.version == 0
    stale = replace(state)
    state.auto_level = 2
    assert store.save(state) is True and state.version == 1
    assert store.save(stale) is False and store.load().auto_level == 2


def test_a_sqlite_state_kept_before_the_version_is_at_version_0(tmp_path: Path) -> None:
    """A data directory's file from the version before (no version column) is read at version 0 and saved on; the
    version is kept beside the state's JSON, which the version before reads (it refuses a field it does not know)."""
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute("CREATE TABLE degrade_state (id INTEGER PRIMARY KEY CHECK (id = 1), state TEXT NOT NULL)")
    conn.execute("INSERT INTO degrade_state VALUES (1, ?)", (json.dumps(OLD),))
    conn.commit()
    store = SqliteLadderStore(tmp_path / "state.db")
    saved_on_from_0(store)
    text, version = conn.execute("SELECT state, version FROM degrade_state").fetchone()
    assert json.loads(text) == {**OLD, "auto_level": 2} and version == 1
    store.close()
    conn.close()


def test_a_redis_state_kept_before_the_version_is_at_version_0(tmp_path: Path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("tg:degrade:state", json.dumps(OLD))
    store = RedisLadderStore(redis_url, SqliteLadderStore(tmp_path / "state.db"))
    saved_on_from_0(store)
    assert json.loads(client.get("tg:degrade:state")) == {**OLD, "auto_level": 2}  # as the version before reads it
    assert client.get("tg:degrade:version") == b"1"
    store.close()
    client.close()


def test_a_postgres_state_kept_before_the_version_is_at_version_0(database_url: str) -> None:
    """A fleet database the version before made (the ladder's migration 1) is migrated and its state read at 0."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate(conn, COMPONENT, MIGRATIONS, upto=1)
        conn.execute("INSERT INTO degrade_state VALUES (1, %s)", (json.dumps(OLD),))
    store = PostgresLadderStore(database_url)
    saved_on_from_0(store)
    with psycopg.connect(database_url) as conn:
        text, version = conn.execute("SELECT state, version FROM degrade_state").fetchone()  # type: ignore[misc]
    assert json.loads(text) == {**OLD, "auto_level": 2} and version == 1
    store.close()


def test_a_store_opens_while_another_writer_holds_the_file(tmp_path: Path) -> None:
    """A file that has the version column opens without the write lock: every worker's start and every CLI read
    (`degrade status`) took it to look for the column, and waited its 5 s out behind a writer, then failed."""
    SqliteLadderStore(tmp_path / "state.db").close()
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        store = SqliteLadderStore(tmp_path / "state.db")
        assert store.load().version == 0
        store.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
