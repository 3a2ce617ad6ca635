"""A ladder save whose EXEC Redis does not answer in time is Redis' fault (the store's 503, after a second try that
would find its own save), not another worker's save: redis-py answers a watched transaction whose connection failed
with a WatchError, as it does a conflict, and the save took it for one (the on-call's change answered "changed by
other workers", Redis' fault never logged, ticks skipped). Real redis-server, its writes paused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import redis

from gateway.errors import Unavailable
from gateway.ladder.state import RedisLadderStore, SqliteLadderStore


def test_a_save_redis_does_not_answer_is_a_redis_fault_not_a_conflict(tmp_path: Path, redis_url: str) -> None:
    store = RedisLadderStore(redis_url, SqliteLadderStore(tmp_path / "state.db"), timeout_s=0.2)
    other = redis.Redis.from_url(redis_url)
    try:
        state = store.load()
        other.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # reads answer, EXEC waits past the timeout
        try:
            with pytest.raises(Unavailable) as refused:
                store.save(replace(state, auto_level=1))
            assert refused.value.code == "ladder_state_unavailable"
        finally:
            other.execute_command("CLIENT", "UNPAUSE")
        now = store.load()
        assert store.save(replace(now, auto_level=2)) and store.load().auto_level == 2  # Redis answers again
    finally:
        other.close()
        store.close()
