"""The ladder on the fleet database: replicas share the level through PostgreSQL alone, or through Redis with
the audit in PostgreSQL; either way every replica's history is the same durable list."""

from __future__ import annotations

from pathlib import Path

import psycopg

from gateway.ladder.state import PostgresLadderStore, RedisLadderStore, open_store
from tests.gateway.ladder.test_controller import make, run


def test_two_replicas_share_the_level_and_the_audit_through_postgres(tmp_path: Path, database_url: str) -> None:
    a, clock, signals, _ = make(tmp_path / "a", open_store(tmp_path / "a", None, database_url))
    b, _, _, _ = make(tmp_path / "b", open_store(tmp_path / "b", None, database_url))
    assert isinstance(a.store, PostgresLadderStore)
    a.set_manual(2, reason="drill", who="k1", ttl_s=600)
    b.tick()
    assert (b.level, b.source) == (2, "manual")
    a.set_auto(who="k1")
    run(a, clock, signals, 11, wait_s=3.0)  # queue waits above level 1's threshold for 10 s: the triggers act
    b.tick()
    assert b.level == a.level == 1
    history = b.store.history()
    assert [e.reason for e in history][-2:] == ["handed back to the triggers", "manual for 600s: drill"]
    assert history[0].who == "auto" and history[0].metrics["queue_wait_p95_s"] == 3.0
    assert [e.reason for e in a.store.history()] == [e.reason for e in history]


def test_with_redis_the_level_is_in_redis_and_the_audit_in_postgres(tmp_path: Path, database_url: str,
                                                                    redis_url: str) -> None:
    a, _, _, _ = make(tmp_path / "a", open_store(tmp_path / "a", redis_url, database_url))
    b, _, _, _ = make(tmp_path / "b", open_store(tmp_path / "b", redis_url, database_url))
    assert isinstance(a.store, RedisLadderStore) and isinstance(a.store.local, PostgresLadderStore)
    a.set_manual(1, reason="upstream slow", who="k1")
    b.tick()
    assert b.level == 1 and [e.reason for e in b.store.history()] == ["manual: upstream slow"]
    with psycopg.connect(database_url) as conn:  # durable where a Redis restart cannot lose it
        assert conn.execute("SELECT who, to_level FROM degrade_events").fetchall() == [("k1", 1)]
        assert conn.execute("SELECT count(*) FROM degrade_state").fetchone() == (0,)  # the level is Redis's
    assert not (tmp_path / "a" / "state.db").exists()  # nothing of the fleet's in a host's data directory
