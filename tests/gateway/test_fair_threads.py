"""FairThreads: jobs of many owners on a few threads, owners in turn."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.fair_threads import FairThreads


def job(name: str, ran: list[str], gate: threading.Event | None = None) -> str:
    if gate is not None:
        gate.wait(5)
    ran.append(name)
    return name


async def settle(threads: FairThreads, running: int) -> None:
    """Until exactly `running` jobs are in the threads (the loop has handed them over)."""
    for _ in range(500):
        await asyncio.sleep(0.002)
        if threads._running == running:
            return
    raise AssertionError(f"{threads._running} jobs running, expected {running}")


async def held_by(owner: str, name: str) -> tuple[FairThreads, list[str], threading.Event, asyncio.Task[str]]:
    """One thread, taken by `owner`'s job `name` until the event returned is set; and the names run, in order."""
    threads, ran, gate = FairThreads(1, "test-fair"), [], threading.Event()
    held = asyncio.create_task(threads.run(owner, job, name, ran, gate))
    await settle(threads, 1)
    return threads, ran, gate, held


def test_a_second_owners_job_runs_before_the_first_owners_queued_ones() -> None:
    async def main() -> list[str]:
        threads, ran, gate, first = await held_by("a", "a0")
        many = [asyncio.create_task(threads.run("a", job, f"a{i}", ran)) for i in range(1, 6)]
        await asyncio.sleep(0)
        other = asyncio.create_task(threads.run("b", job, "b0", ran))
        await asyncio.sleep(0)
        assert threads.queued == 6
        gate.set()
        assert await other == "b0"
        await asyncio.gather(first, *many)
        threads.close()
        return ran

    ran = asyncio.run(main())
    assert ran.index("b0") == 2, ran  # after the job running and at most one of a's queued ones
    assert [r for r in ran if r.startswith("a")] == [f"a{i}" for i in range(6)]  # each owner's in its order


def test_owners_alternate_while_both_have_work() -> None:
    async def main() -> list[str]:
        threads, ran, gate, held = await held_by("x", "x")
        jobs = [asyncio.create_task(threads.run("a", job, f"a{i}", ran)) for i in range(3)]
        jobs += [asyncio.create_task(threads.run("b", job, f"b{i}", ran)) for i in range(3)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(held, *jobs)
        threads.close()
        return ran

    assert asyncio.run(main()) == ["x", "a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_job_whose_caller_left_before_its_turn_never_runs_and_errors_reach_the_caller() -> None:
    def fails() -> None:
        raise ValueError("bad input")

    async def main() -> list[str]:
        threads, ran, gate, held = await held_by("a", "held")
        left = asyncio.create_task(threads.run("b", job, "left", ran))
        await asyncio.sleep(0)
        left.cancel()
        gate.set()
        assert await held == "held"
        with pytest.raises(ValueError, match="bad input"):
            await threads.run("c", fails)
        assert await threads.run("c", job, "after", ran) == "after"  # the failed job freed its thread
        assert left.cancelled()
        threads.close()
        return ran

    assert asyncio.run(main()) == ["held", "after"]


def test_closing_cancels_the_queued_jobs_and_refuses_new_ones() -> None:
    async def main() -> None:
        threads, ran, gate, held = await held_by("a", "held")
        queued = asyncio.create_task(threads.run("b", job, "queued", ran))
        await asyncio.sleep(0)
        threads.close()
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(RuntimeError, match="closed"):
            await threads.run("c", job, "late", ran)
        gate.set()
        assert await held == "held"  # a running job ends in its thread
        assert ran == ["held"]

    asyncio.run(main())
