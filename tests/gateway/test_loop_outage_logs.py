"""What the background loops log through a store's outage: each fault once (a store's fault one line, no
traceback), then one "recovered after N failed rounds" line; not a line and a traceback every round. A bug (an
unexpected exception) keeps its traceback, once per distinct message. Driven by a real redis-server of the test's
own, stalled (SIGSTOP) or killed and started again."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.app import _every
from gateway.ladder.state import RedisLadderStore, SqliteLadderStore
from quotas.backends.redis import RedisBackend
from quotas.reaper import run_reaper
from tests.conftest import RedisServer

ROUNDS = 12


async def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the loop did not get there in time"
        await asyncio.sleep(0.01)


def _lines(caplog: pytest.LogCaptureFixture, what: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if what in r.getMessage()]


def test_the_ladder_tick_logs_a_stalled_redis_once_then_its_recovery(
        own_redis: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RedisLadderStore(own_redis.url, SqliteLadderStore(tmp_path / "state.db"), timeout_s=0.05)
    calls = {"failed": 0, "ok": 0}

    def tick() -> None:
        try:
            store.load()
        except Exception:
            calls["failed"] += 1
            raise
        calls["ok"] += 1

    async def outage() -> None:
        loop = asyncio.create_task(_every(0.01, tick, "degradation ladder tick"))
        try:
            await _until(lambda: calls["ok"] >= 1)
            assert own_redis.proc is not None
            os.kill(own_redis.proc.pid, signal.SIGSTOP)  # Redis stalls: every read times out
            await _until(lambda: calls["failed"] >= ROUNDS)
            os.kill(own_redis.proc.pid, signal.SIGCONT)
            ok = calls["ok"]
            await _until(lambda: calls["ok"] >= ok + 3)
        finally:
            loop.cancel()

    with caplog.at_level(logging.INFO, logger="tiergate"):
        asyncio.run(outage())
    store.close()
    lines = _lines(caplog, "degradation ladder tick")
    failed = [r for r in lines if "failed" in r.getMessage()]
    recovered = [r for r in lines if "recovered after" in r.getMessage()]
    assert 1 <= len(failed) <= 2, [r.getMessage() for r in lines]  # a timeout (and perhaps a refused reconnect)
    assert all(r.exc_info is None for r in failed)  # a store's fault: one line, no traceback
    assert "ladder_state_unavailable" in failed[0].getMessage() or "Redis" in failed[0].getMessage()
    assert len(recovered) == 1 and f"after {calls['failed']} failed rounds" in recovered[0].getMessage()


def test_the_reaper_logs_a_dead_redis_once_a_loop_then_its_recovery(
        own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    renewals = {"n": 0}

    async def outage() -> None:
        backend = RedisBackend(own_redis.url, timeout_s=0.05)
        reaps = {"failed": 0, "ok": 0}
        reap = backend.reap

        async def counted(billed: object = None) -> int:
            try:
                n = await reap(billed)  # type: ignore[arg-type]
            except Exception:
                reaps["failed"] += 1
                raise
            reaps["ok"] += 1
            return n

        backend.reap = counted  # type: ignore[method-assign]

        async def renew() -> None:
            renewals["n"] += 1
            await backend.redis.ping()  # the renewal's store, down with it

        loop = asyncio.create_task(run_reaper(backend, every_s=0.01, renew=renew))
        try:
            await _until(lambda: reaps["ok"] >= 1)
            own_redis.stop()  # Redis dies: every call is refused
            await _until(lambda: reaps["failed"] >= ROUNDS)
            own_redis.start()  # and comes back on its port
            ok = reaps["ok"]
            await _until(lambda: reaps["ok"] >= ok + 3)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await backend.close()

    with caplog.at_level(logging.INFO, logger="tiergate"):
        asyncio.run(outage())
    for what in ("reaping expired reservations", "renewing the leases of running requests"):
        lines = _lines(caplog, what)
        failed = [r for r in lines if "failed" in r.getMessage()]
        assert 1 <= len(failed) <= 3, [r.getMessage() for r in lines]  # O(1), not one a round
        assert all(r.exc_info is None for r in failed)
        assert [r for r in lines if "recovered after" in r.getMessage()], [r.getMessage() for r in lines]


def test_a_bug_in_a_loop_keeps_its_traceback_once_per_distinct_message(caplog: pytest.LogCaptureFixture) -> None:
    rounds = {"n": 0}

    def work() -> None:
        rounds["n"] += 1
        if rounds["n"] <= ROUNDS:
            raise KeyError("a" if rounds["n"] <= ROUNDS // 2 else "b")  # a bug, not a store's fault

    async def run() -> None:
        loop = asyncio.create_task(_every(0.001, work, "evaluating rollout guards"))
        await _until(lambda: rounds["n"] >= ROUNDS + 2)
        loop.cancel()

    with caplog.at_level(logging.INFO, logger="tiergate"):
        asyncio.run(run())
    lines = _lines(caplog, "evaluating rollout guards")
    bugs = [r for r in lines if r.exc_info is not None]
    assert [r.exc_info[1].args for r in bugs] == [("a",), ("b",)]  # type: ignore[index]
    assert all(r.levelno == logging.ERROR for r in bugs)
    assert [r.getMessage() for r in lines if "recovered" in r.getMessage()] == [
        f"evaluating rollout guards recovered after {ROUNDS} failed rounds"]
