"""gateway/report_gate.py: one report per tenant, a bound on all, slots held until the report's thread is done;
the admin's slot outside the tenants'; reports summed in report processes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.errors import RateLimited
from gateway.report_gate import ADMIN_SLOT, ReportGate
from quotas.ledger import Ledger, LedgerRow, Refusal
from quotas.report import usage_report
from tests.postgres import LedgerStore

DAY = 1_800_000_000.0


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


def test_the_admins_report_runs_while_tenants_hold_every_slot_and_thread() -> None:
    """The admin's slot is outside the tenants' limit, and its thread outside theirs: eight tenants' reports (the
    limit) running or waiting neither refuse the admin's report nor hold it up (before: refused with a 429)."""
    async def scenario() -> None:
        gate, release = ReportGate(threads=2, limit=8), threading.Event()
        try:
            tenants = [asyncio.ensure_future(gate.run(f"t{i}", lambda: release.wait(10) and "tenant's"))
                       for i in range(8)]
            await asyncio.sleep(0.05)
            with pytest.raises(RateLimited, match="8 usage reports are running"):
                await gate.run("t8", lambda: "one too many")
            admin = await asyncio.wait_for(gate.run(ADMIN_SLOT, lambda: "admin's"), 5)
            assert admin == "admin's" and not any(t.done() for t in tenants)
            release.set()
            assert await asyncio.gather(*tenants) == ["tenant's"] * 8
        finally:
            release.set()
            gate.close()

    asyncio.run(scenario())


def mixed_ledger(ledger: Ledger) -> Ledger:
    ledger.record_now(
        [LedgerRow(f"r{i}", DAY + i * 3600, ["acme", "globex"][i % 2], f"k{i % 3}", ["mid", "full"][i % 2], "m",
                   "ok", 200, 10 + i, 5, Decimal("0.000123") * (i + 1), Decimal("1E-7"), "engine", 0.1, 0.2,
                   cache_status="hit" if i % 4 == 0 else "miss") for i in range(60)],
        refusals=[Refusal(f"x{i}", DAY + i * 600, "acme", "k1", ["rate_limit_rpm", "invalid_json"][i % 2], 429)
                  for i in range(40)])
    return ledger


def test_a_report_is_read_and_summed_in_a_report_process(ledger_store: LedgerStore) -> None:
    """The report's reading and summing runs in a process of its own (not the gateway's interpreter), on a
    read-only connection it opens from where the ledger is (SQLite file, PostgreSQL URL); the answer is the one
    summed here. Its errors come back as they were raised; its process is replaced after `tasks_per_process`."""
    ledger = mixed_ledger(ledger_store.open())

    async def scenario() -> None:
        gate = ReportGate(tasks_per_process=2)
        try:
            assert gate.processes is not None
            for by in (("tenant", "tier"), ("day", "key_id"), ("tenant", "day")):
                here = usage_report(ledger, by=by, tenant="acme")
                assert await gate.report("acme", ledger, by=by, tenant="acme") == here
            pids = gate.processes.pids()
            assert len(pids) == 1 and os.getpid() not in pids
            with pytest.raises(ValueError, match="cannot group by"):
                await gate.report("acme", ledger, by=("planet",))
            assert gate.processes.pids() != pids  # replaced after two reports
        finally:
            gate.close()
        assert gate.processes.pids() == []

    asyncio.run(scenario())
    ledger.close()


def test_a_report_process_that_dies_fails_its_report_only(tmp_path: Path) -> None:
    from quotas.report_worker import ReportProcessFailed  # imported here: the file's other tests run without it

    ledger = mixed_ledger(Ledger(tmp_path / "ledger.db"))

    async def scenario() -> None:
        gate = ReportGate()
        try:
            assert gate.processes is not None
            first = await gate.report("acme", ledger, by=("tenant",))
            (pid,) = gate.processes.pids()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ReportProcessFailed, match="exited"):
                await gate.report("acme", ledger, by=("tenant",))
            assert await gate.report("acme", ledger, by=("tenant",)) == first  # a new process
            assert gate.processes.pids() != [pid]
        finally:
            gate.close()

    asyncio.run(scenario())
    ledger.close()
