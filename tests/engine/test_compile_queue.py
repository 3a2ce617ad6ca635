"""The compile queue (engine/compile_queue.py): threads of its own, tenants in turn, bounded; jobs that block on events
make every ordering deterministic."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest

from engine.compile_queue import COMPILE_NICE, CompileQueue, EngineBusyError

WAIT_S = 5.0  # a bound on waiting for a thread, never reached when the queue works


class Jobs:
    """Jobs that record when they start and finish only when released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self._cond = threading.Condition()

    def job(self, name: str) -> Callable[[], str]:
        gate = self.gates[name] = threading.Event()

        def run() -> str:
            with self._cond:
                self.started.append(name)
                self._cond.notify_all()
            assert gate.wait(WAIT_S)
            return name
        return run

    def wait_started(self, n: int) -> list[str]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= n, WAIT_S), self.started
            return list(self.started)


def test_a_flooding_tenant_delays_another_by_one_compile_at_most() -> None:
    """One worker: tenant a queues 8 compiles; b's, queued after them, runs as soon as a's running one ends."""
    q, jobs = CompileQueue(workers=1), Jobs()
    flood = [q.submit("a", jobs.job(f"a{i}")) for i in range(8)]
    assert jobs.wait_started(1) == ["a0"]
    victim = q.submit("b", jobs.job("b0"))
    jobs.gates["a0"].set()
    assert jobs.wait_started(2) == ["a0", "b0"]  # before a1..a7
    jobs.gates["b0"].set()
    assert victim.result(WAIT_S) == "b0"
    for gate in jobs.gates.values():
        gate.set()
    assert [f.result(WAIT_S) for f in flood] == [f"a{i}" for i in range(8)]  # a's own in its order


def test_with_a_free_worker_another_tenant_waits_for_none() -> None:
    """Two workers: a tenant runs one compile at a time, so the other worker is free for anyone else."""
    q, jobs = CompileQueue(workers=2), Jobs()
    for i in range(6):
        q.submit("a", jobs.job(f"a{i}"))
    assert jobs.wait_started(1) == ["a0"]
    victim = q.submit("b", jobs.job("b0"))
    assert jobs.wait_started(2) == ["a0", "b0"]  # while a0 still runs
    jobs.gates["b0"].set()
    assert victim.result(WAIT_S) == "b0"
    assert jobs.started == ["a0", "b0"]
    for gate in jobs.gates.values():
        gate.set()


def test_tenants_take_turns() -> None:
    q, jobs = CompileQueue(workers=1), Jobs()
    q.submit("blocker", jobs.job("x"))
    jobs.wait_started(1)
    futures = [q.submit(t, jobs.job(f"{t}{i}")) for t in ("a", "b", None) for i in range(3)]
    for gate in jobs.gates.values():
        gate.set()
    for f in futures:
        f.result(WAIT_S)
    assert jobs.started == ["x", "a0", "b0", "None0", "a1", "b1", "None1", "a2", "b2", "None2"]


class WatchedCondition(threading.Condition):
    """The queue's condition, counting the waits on it of the thread that made it (the test's, which submits)."""

    def __init__(self) -> None:
        super().__init__()
        self.owner, self.owner_waits = threading.get_ident(), 0

    def wait(self, timeout: float | None = None) -> bool:
        if threading.get_ident() == self.owner:
            self.owner_waits += 1
        return super().wait(timeout)


def test_a_full_queue_refuses_at_once() -> None:
    """Refused while every job holding a place is still held at its gate, and without waiting on the queue: a
    submit that waited for a place would be let in once a0's gate gave up (WAIT_S), one that waited a while and then
    refused waits on the queue's condition."""
    q, jobs = CompileQueue(workers=1, per_tenant=3, total=5), Jobs()
    q._cond = watched = WatchedCondition()
    held = [q.submit("a", jobs.job(f"a{i}")) for i in range(3)]
    with pytest.raises(EngineBusyError, match="tenant's") as exc:
        q.submit("a", jobs.job("a3"))
    assert exc.value.param == "response_format" and exc.value.retry_after_s >= 1
    held += [q.submit("b", jobs.job("b0")), q.submit("c", jobs.job("c0"))]
    with pytest.raises(EngineBusyError, match="engine's"):
        q.submit("d", jobs.job("d0"))
    assert q.num_refused == 2 and watched.owner_waits == 0  # never waits
    assert not any(f.done() for f in held) and jobs.started in ([], ["a0"])  # no place freed before the refusals
    jobs.wait_started(1)
    jobs.gates["a0"].set()
    jobs.wait_started(2)  # a0 done: one place free again
    q.submit("d", jobs.job("d1"))
    for gate in jobs.gates.values():
        gate.set()


def test_a_job_cancelled_before_it_starts_frees_its_place_and_never_runs() -> None:
    q, jobs = CompileQueue(workers=1, per_tenant=2), Jobs()
    q.submit("a", jobs.job("a0"))
    jobs.wait_started(1)
    waiting = q.submit("a", jobs.job("a1"))
    with pytest.raises(EngineBusyError):
        q.submit("a", jobs.job("a2"))
    assert waiting.cancel()
    last = q.submit("a", jobs.job("a3"))  # the cancelled one's place
    for gate in jobs.gates.values():
        gate.set()
    assert last.result(WAIT_S) == "a3"
    assert jobs.started == ["a0", "a3"]


async def test_jobs_all_their_callers_left_before_they_started_leave_the_queue() -> None:
    """A tenant fills its places with requests it then abandons (a compile shared by two callers among them): its
    places are free at once, its next compile runs next, the abandoned ones never run, and the shared one, which one
    caller still waits for, runs for it."""
    q, jobs = CompileQueue(workers=1, per_tenant=4), Jobs()
    q.submit("other", jobs.job("x"))
    jobs.wait_started(1)  # the one worker busy: a's jobs wait in the queue
    abandoned = [asyncio.create_task(q.join(q.submit("a", jobs.job(f"a{i}")))) for i in range(3)]
    shared = q.submit("a", jobs.job("shared"))
    leaving, staying = asyncio.create_task(q.join(shared)), asyncio.create_task(q.join(shared))
    await asyncio.sleep(0)  # every caller waits
    with pytest.raises(EngineBusyError, match="tenant's"):
        q.submit("a", jobs.job("refused"))
    for task in [*abandoned, leaving]:
        task.cancel()
    await asyncio.gather(*abandoned, leaving, return_exceptions=True)
    # at HEAD's shielded waiting, the four places stay taken until the abandoned jobs have run
    fresh = [q.submit("a", jobs.job(f"fresh{i}")) for i in range(3)]
    for gate in jobs.gates.values():
        gate.set()
    assert await staying == "shared"
    assert [await asyncio.wrap_future(f) for f in fresh] == ["fresh0", "fresh1", "fresh2"]
    assert jobs.started == ["x", "shared", "fresh0", "fresh1", "fresh2"]  # a0..a2 never ran
    assert not q._waiters


async def test_a_job_running_when_its_callers_leave_finishes_and_then_frees_its_place() -> None:
    q, jobs = CompileQueue(workers=1, per_tenant=1), Jobs()
    job = q.submit("a", jobs.job("a0"))
    caller = asyncio.create_task(q.join(job))
    jobs.wait_started(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    with pytest.raises(EngineBusyError):  # still running: still its place
        q.submit("a", jobs.job("a1"))
    jobs.gates["a0"].set()
    assert job.result(WAIT_S) == "a0"  # not cancelled: what it made is kept (the engine's grammar cache)
    deadline = time.monotonic() + WAIT_S
    while "a" in q._pending and time.monotonic() < deadline:  # its thread frees the place just after the result
        time.sleep(0.001)
    assert q.submit("a", lambda: 1).result(WAIT_S) == 1


def test_a_failing_job_fails_its_future_alone() -> None:
    q = CompileQueue(workers=1)

    def boom() -> None:
        raise ValueError("bad schema")

    failed = q.submit("a", boom)
    with pytest.raises(ValueError, match="bad schema"):
        failed.result(WAIT_S)
    assert q.submit("a", lambda: 7).result(WAIT_S) == 7


@pytest.mark.skipif(not hasattr(os, "setpriority") or sys.platform != "linux", reason="per-thread priorities: Linux")
def test_compiles_run_below_the_callers_priority() -> None:
    q = CompileQueue(workers=1)

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = priority()
    assert q.submit("a", priority).result(WAIT_S) == min(before + COMPILE_NICE, 19)
    assert priority() == before  # the thread's own, not the process's


def test_closed_its_threads_end_after_the_queued_compiles() -> None:
    q, jobs = CompileQueue(workers=2), Jobs()
    futures = [q.submit("a", jobs.job("a0")), q.submit("b", jobs.job("b0")), q.submit("a", jobs.job("a1"))]
    jobs.wait_started(2)
    q.close()
    with pytest.raises(EngineBusyError, match="shutting down"):
        q.submit("c", jobs.job("c0"))
    for gate in jobs.gates.values():
        gate.set()
    assert [f.result(WAIT_S) for f in futures] == ["a0", "b0", "a1"]
    for thread in q._threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
