"""Money exact under faults: three replicas' quota state on one real Redis under load from two tenants, one
replica SIGKILLed while it holds reservations, Redis frozen (SIGSTOP) for 2 s, then restarted. Loopback
only; one round of bench/quota_faults.py, with progress counted in ledger rows, not timed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.quota_faults import UB_PICO, Scenario, run_scenario


def test_every_picodollar_is_where_the_ledger_says_after_kill_freeze_and_restart(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    report = run_scenario(tmp_path, Scenario(replicas=3, workers=3, rounds=1, rows_per_phase=100),
                          log=True)  # the phases' times, shown if it fails
    assert [f.split(" holding")[0] for f in report.faults] == ["SIGKILL r0", "SIGSTOP redis 2s", "restart redis"]
    for name, tenant in report.tenants.items():
        assert tenant.drift_pico == 0, (name, tenant)  # Redis' spend is the ledger's, to the picodollar
        assert tenant.overshoot_pico <= UB_PICO, (name, tenant)  # never a budget again after an outage
    tight = report.tenants["tight"]
    assert tight.ledger_pico > tight.budget_pico - UB_PICO  # its budget really ran out under the load
    assert report.slots_held == 0 and report.reservations_held == 0  # nothing held after the lease
    totals = report.totals
    assert totals["reaped"] + report.reaped_at_end >= 1  # the killed replica's runs came back
    assert totals["local"] > 0  # the replicas failed open ...
    assert totals["journal"] + totals["journal_requests"] > 0  # ... and what they settled so reached Redis
