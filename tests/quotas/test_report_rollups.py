"""Kept day sums (quotas/report_rollups.py): a report asked again is the report every row gives, to the digit, as
rows and refusals arrive late (inside the grace and long after it), refusal counts are pruned and a ledger is
replaced by another at the same place; it reads only what it does not keep; its memory is bounded per tenant and
in all; and a report process keeps them between reports (SQLite and PostgreSQL)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import tracemalloc
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from quotas import report
from quotas.ledger import Ledger, LedgerRow, Refusal
from quotas.ledger_reads import ReadSource, store_identity
from quotas.report import jsonable, report_at, usage_report
from quotas.report_rollups import DayRollups
from quotas.report_worker import ReportProcesses
from tests.postgres import LedgerStore, open_ledger_at
from tests.quotas.test_report_totals import DAY, mixed_refusals, mixed_rows

D = 86400
NOW = DAY + 10 * D  # the tests' clock: the mixed rows' days are closed
PAST = 1_767_225_600  # 2026-01-01: closed by the real clock too (report_at's)


def kept_report(ledger: Ledger, rollups: DayRollups, **query: Any) -> list[dict[str, Any]]:
    source = ledger.read_source()
    return usage_report(ledger, rollups=(rollups, source, store_identity(source, ledger)), **query)


def assert_same(ledger: Ledger, rollups: DayRollups, **query: Any) -> None:
    """The report from kept days is the one every row gives: values, decimal places, order of reasons."""
    got, full = kept_report(ledger, rollups, **query), usage_report(ledger, **query)
    assert json.dumps(jsonable(got)) == json.dumps(jsonable(full)), query


def row(rid: str, ts: float, tenant: str = "acme", key: str = "k1", price: str = "0.000123") -> LedgerRow:
    return LedgerRow(rid, ts, tenant, key, "mid", "m", "ok", 200, 7, 3, Decimal(price), Decimal("1E-7"), "engine",
                     0.1, 0.2, cache_status="hit")


QUERIES = [dict(by=by, since=since, until=until, tenant=tenant) for by, (since, until), tenant in itertools.product(
    [("tenant",), ("tenant", "day"), ("day", "tier"), ("key_id", "tier", "day", "tenant")],
    [(None, None), (DAY, None), (None, DAY + 2 * D), (DAY + 30.5, DAY + D + 90.25), (DAY + D, DAY + 3 * D)],
    [None, "acme"])]


def test_kept_days_give_the_full_report_as_rows_arrive_late(ledger_store: LedgerStore) -> None:
    """Every grouping and range, before and after rows and refusals arrive: in an open day, in kept days long past
    their grace (a new row, one in a day that had none, a refusal added to a minute's count, a new refusal), before
    the first row; a report asked again sums only the days that changed."""
    ledger = ledger_store.open()
    ledger.record_now(mixed_rows(), refusals=mixed_refusals())
    rollups = DayRollups(clock=lambda: NOW)
    for query in QUERIES:
        assert_same(ledger, rollups, **query)
    assert rollups.reused_days > 0
    summed = rollups.summed_days
    for query in QUERIES:
        kept_report(ledger, rollups, **query)
    assert rollups.summed_days == summed  # asked again: no kept day summed again

    ledger.record_now([row("late-1", DAY + D + 5, price="0.5"), row("late-2", DAY + 6 * D + 1, "globex"),
                       row("open", NOW - 60), row("before", -2 * D, "acme", "k9")],
                      refusals=[Refusal("late-x", DAY - 3600 + 1, "acme", "k0", "rate_limit_rpm", 429),  # +1 in place
                                Refusal("late-y", DAY + 2 * D + 7, "globex", "k1", "budget", 429)])
    summed = rollups.summed_days
    kept_report(ledger, rollups, by=("tenant",))
    assert 0 < rollups.summed_days - summed <= 6  # the changed days (and the new first one), not the ~20,800 kept
    for query in QUERIES:
        assert_same(ledger, rollups, **query)
    (acme,) = kept_report(ledger, rollups, by=("tenant",), tenant="acme", since=DAY + D, until=DAY + 2 * D)
    assert acme["price_usd"] == sum((r.price_usd for r in ledger.each_row(tenant="acme", since=DAY + D,
                                                                           until=DAY + 2 * D)), Decimal(0))
    ledger.close()


def test_a_late_row_inside_the_grace_is_counted(ledger_store: LedgerStore) -> None:
    """A day inside its grace is read from its rows: a row arriving then is counted. Past the grace the day is kept,
    and a row arriving later still is counted too (the kept day's count no longer matches): the day is summed again,
    once."""
    ledger = ledger_store.open()
    ledger.record_now([row(f"r{i}", DAY + i * 3000) for i in range(20)])
    now = [DAY + D + 1800]
    rollups = DayRollups(clock=lambda: now[0], grace_s=3600)
    assert_same(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert rollups.cells == 0  # inside its grace: not kept
    ledger.record_now([row("late-1", DAY + D - 1, price="0.25")])
    (day,) = kept_report(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert day["requests"] == 21 and day["price_usd"] == Decimal("0.25") + 20 * Decimal("0.000123")
    assert_same(ledger, rollups, by=("tenant", "day"), tenant="acme")

    now[0] = DAY + D + 7200  # past its grace: kept
    assert_same(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert rollups.cells > 0 and rollups.summed_days == 1
    ledger.record_now([row("late-2", DAY + 10, price="0.5")])
    (day,) = kept_report(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert day["requests"] == 22 and rollups.summed_days == 2
    assert_same(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert rollups.summed_days == 2 and rollups.reused_days >= 1
    ledger.close()


def test_pruned_refusal_counts_are_not_served_from_kept_days(ledger_store: LedgerStore) -> None:
    """The retention deletes every refusal minute before a cut: kept days it reached are summed again."""
    ledger = ledger_store.open()
    ledger.record_now(mixed_rows(), refusals=mixed_refusals())
    rollups = DayRollups(clock=lambda: NOW)
    for query in QUERIES[:10]:
        assert_same(ledger, rollups, **query)
    ledger_store.sql(f"DELETE FROM refusal_counts WHERE minute < {int(DAY + D + 3600)}")
    for query in QUERIES:
        assert_same(ledger, rollups, **query)
    ledger.close()


@pytest.fixture
def own_rollups(monkeypatch: pytest.MonkeyPatch) -> Iterator[DayRollups]:
    """report_at's kept sums and readers, fresh for the test."""
    rollups = DayRollups()
    monkeypatch.setattr(report, "ROLLUPS", rollups)
    monkeypatch.setattr(report, "_readers", {})
    yield rollups
    for reader, _ in report._readers.values():
        reader.close()


def history(prices: str) -> tuple[list[LedgerRow], list[Refusal]]:
    rows = [row(f"r{i}", PAST + i * 7000, ["acme", "globex"][i % 2], f"k{i % 3}", price=prices) for i in range(60)]
    return rows, [Refusal(f"x{i}", PAST + i * 900, "acme", "k1", "rate_limit_rpm", 429) for i in range(40)]


def test_a_report_process_keeps_closed_days_for_the_next_report(ledger_store: LedgerStore,
                                                                own_rollups: DayRollups) -> None:
    """report_at (what a report process runs): the second report sums no kept day, and equals the full one."""
    ledger = ledger_store.open()
    rows, refusals = history("0.000123")
    ledger.record_now(rows, refusals=refusals)
    source = ledger.read_source()
    for by in (("tenant", "day"), ("tenant", "tier"), ("key_id",)):
        assert report_at(source, by=by, tenant="acme") == usage_report(ledger, by=by, tenant="acme")
    assert own_rollups.summed_days > 0 and own_rollups.reused_days > 0
    summed = own_rollups.summed_days
    ledger.record_now([row("today", own_rollups.clock() - 5)])  # an open day: read from its rows
    assert report_at(source, by=("tenant", "day"), tenant="acme") == usage_report(ledger, by=("tenant", "day"),
                                                                                  tenant="acme")
    assert own_rollups.summed_days == summed
    ledger.close()


def test_another_ledger_at_the_same_place_is_not_served(ledger_store: LedgerStore, own_rollups: DayRollups,
                                                        request: pytest.FixtureRequest) -> None:
    """A ledger reset or restored under the same SQLite path, or a PostgreSQL database dropped and made again under
    its name, with as many rows and refusals in the same days (other prices): the report is the new ledger's."""
    ledger = ledger_store.open()
    ledger.record_now(*history("0.000123"))
    source = ledger.read_source()
    before = report_at(source, by=("tenant", "day"))
    assert before == usage_report(ledger, by=("tenant", "day")) and own_rollups.cells > 0
    ledger.close()
    if ledger_store.kind == "sqlite":
        for path in Path(ledger_store.target).parent.glob("ledger.db*"):
            os.remove(path)  # the report process's reader still has the old file open
    else:
        server = request.getfixturevalue("postgres_server")
        name = ledger_store.target.rsplit("/", 1)[1]
        server.drop_database(ledger_store.target)
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    ledger = open_ledger_at(ledger_store.target)
    ledger.record_now(*history("0.5"))
    after = report_at(source, by=("tenant", "day"))
    assert after == usage_report(ledger, by=("tenant", "day")) and after != before
    ledger.close()


def test_memory_is_bounded_per_tenant_and_in_all(tmp_path: Path) -> None:
    """A tenant with many keys over many days keeps at most its own bound (its oldest days go), and never takes the
    others' kept days; past the bound in all, the tenant holding the most gives way. Evicted days are summed again
    when asked: the reports stay exact. A kept cell takes under 1 KiB."""
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record_now([row(f"m{d}-{k}", PAST + d * D + k, "mallory", f"k{k}") for d in range(40) for k in range(5)]
                      + [row(f"{t}{d}", PAST + d * D, t) for t in ("acme", "globex") for d in range(10)])
    rollups = DayRollups(max_cells=80, max_cells_per_scope=60, clock=lambda: PAST + 60 * D)
    for tenant in ("acme", "globex"):
        assert_same(ledger, rollups, by=("tenant", "day"), tenant=tenant)
    place = ledger.read_source()
    assert rollups.cells_of(place, "acme") == rollups.cells_of(place, "globex") == 11  # 10 days and one range
    for _ in range(3):
        assert_same(ledger, rollups, by=("tenant", "day", "key_id"), tenant="mallory")
        assert rollups.cells_of(place, "mallory") <= 60 and rollups.cells <= 80
        assert rollups.cells_of(place, "acme") == rollups.cells_of(place, "globex") == 11
    assert_same(ledger, rollups, by=("tenant", "day"), tenant="acme")
    assert rollups.cells_of(place, "acme") == 11 and rollups.cells <= 80
    ledger.close()

    ledger = Ledger(tmp_path / "big.db")
    ledger.record_now([LedgerRow(f"b{d}-{k}-{t}", PAST + d * D + k, "acme", f"key-{k}", t, "m", "ok", 200, 7, 3,
                                 Decimal(f"0.{d:03d}{k:02d}7"), Decimal(f"0.000{k}1"), "engine", 0.1, 0.2,
                                 cache_saving_usd=Decimal(f"0.00{d}"), route_saving_usd=Decimal(f"0.0{k}"))
                       for d in range(30) for k in range(10) for t in ("small", "mid", "full")],
                      refusals=[Refusal(f"x{d}-{k}-{r}", PAST + d * D + 60 * r, "acme", f"key-{k}", f"reason-{r}", 429)
                                for d in range(30) for k in range(10) for r in range(3)])
    rollups = DayRollups(clock=lambda: PAST + 31 * D)
    kept_report(ledger, rollups, by=("tenant",), tenant="acme", until=PAST + D)  # the reader's own memory first
    rollups = DayRollups(clock=lambda: PAST + 31 * D)
    gc.collect()
    tracemalloc.start()
    try:
        kept_report(ledger, rollups, by=("tenant",), tenant="acme")
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rollups.cells == 30 * 60 + 1
    assert held / rollups.cells < 1024, held / rollups.cells
    ledger.close()


def test_a_tenants_report_goes_to_the_process_that_kept_its_days(tmp_path: Path) -> None:
    """Of the idle report processes, a tenant's report takes the one that made its last report (its days are kept
    there); a process whose memory passes `max_rss` is replaced after its report."""
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record_now(*history("0.000123"))
    source = ledger.read_source()
    processes = ReportProcesses()
    try:
        acme = processes._take((tuple(source), "acme"))
        globex = processes._take((tuple(source), "globex"))
        processes._give_back(acme)
        processes._give_back(globex)  # the most recently idle
        assert processes.report(source, by=("tenant",), tenant="acme") == usage_report(ledger, by=("tenant",),
                                                                                       tenant="acme")
        assert processes._take((tuple(source), "acme")) is acme
        processes._give_back(acme)
        pids = processes.pids()
        assert len(pids) == 2 and acme.rss > 0
        processes.max_rss = 1
        processes.report(source, by=("tenant",), tenant="globex")
        assert globex.pid not in processes.pids() and acme.pid in processes.pids()
    finally:
        processes.close()
    ledger.close()


def test_a_report_process_logs_no_traceback_for_a_ledger_it_cannot_reach(capfd: pytest.CaptureFixture[str]) -> None:
    """The database down (here a port nothing listens on): the report's error reaches the caller, which logs the
    outage once (gateway/report_gate.py), and the report process writes nothing; it logged a traceback a report."""
    processes = ReportProcesses()
    try:
        for _ in range(3):
            with pytest.raises(psycopg.OperationalError):
                processes.report(ReadSource("postgres", "postgresql://u@127.0.0.1:9/x?connect_timeout=2"),
                                 by=("tenant",))
    finally:
        processes.close()
    assert "usage report failed" not in capfd.readouterr().err
