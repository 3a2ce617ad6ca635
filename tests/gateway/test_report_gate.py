"""gateway/report_gate.py: one report per tenant, a bound on all, slots held until the report's thread is done."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.errors import RateLimited
from gateway.report_gate import ReportGate


def test_a_tenant_runs_one_report_at_a_time_and_all_are_bounded() -> None:
    async def scenario() -> None:
        gate, release = ReportGate(threads=1, limit=2), threading.Event()
        try:
            first = asyncio.ensure_future(gate.run("acme", lambda: release.wait(10) and "acme's"))
            await asyncio.sleep(0.05)
            with pytest.raises(RateLimited, match="still running"):
                await gate.run("acme", lambda: "again")
            second = asyncio.ensure_future(gate.run("beta", lambda: "beta's"))  # waits for the one thread
            await asyncio.sleep(0.05)
            with pytest.raises(RateLimited, match="2 usage reports are running"):
                await gate.run("gamma", lambda: "gamma's")
            release.set()
            assert await first == "acme's" and await second == "beta's"
            assert await gate.run("acme", lambda: "later") == "later"
        finally:
            gate.close()

    asyncio.run(scenario())


def test_a_client_that_leaves_does_not_free_its_slot_before_the_report_ends() -> None:
    async def scenario() -> None:
        gate, release, ended = ReportGate(threads=1), threading.Event(), threading.Event()

        def work() -> str:
            release.wait(10)
            ended.set()
            return "done"

        try:
            task = asyncio.ensure_future(gate.run("acme", work))
            await asyncio.sleep(0.05)
            task.cancel()  # the client disconnected
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(RateLimited):  # its report still runs: asking again does not stack a second
                await gate.run("acme", lambda: "again")
            release.set()
            assert await asyncio.to_thread(ended.wait, 10)
            for _ in range(100):  # the slot is released by the report's thread right after it ends
                try:
                    assert await gate.run("acme", lambda: "again") == "again"
                    break
                except RateLimited:
                    await asyncio.sleep(0.01)
            else:
                raise AssertionError("the slot was never released")
        finally:
            gate.close()

    asyncio.run(scenario())


def test_a_report_that_fails_frees_its_slot() -> None:
    async def scenario() -> None:
        gate = ReportGate()
        try:
            with pytest.raises(ZeroDivisionError):
                await gate.run("acme", lambda: 1 / 0)
            assert await gate.run("acme", lambda: "ok") == "ok"
        finally:
            gate.close()

    asyncio.run(scenario())
