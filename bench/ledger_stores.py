"""Ledger commit throughput and the latency it adds to a request: SQLite (embedded) vs PostgreSQL (a fleet).

    .venv/bin/python -m bench.ledger_stores [--seconds 3] [--writers 1,4,16] [--database-url postgresql://…]
    .venv/bin/python -m bench.ledger_stores claims [--held 10,9000] [--claims 500]

`claims`: what claiming an Idempotency-Key costs on PostgreSQL as the tenant's live records grow. For each count of
records the tenant already holds (written straight into a fresh database), one client claims `--claims` new keys one
after another, then, with the tenant at its bound (MAX_RECORDS_PER_TENANT live records), asks for `--claims` more
(each refused): p50 and p99 of `begin`, in ms. The claim's cost should not grow with the records held.

    .venv/bin/python -m bench.ledger_stores reports [--requests 500000] [--refusals 1000000] [--days 30]

`reports`: what one tenant's usage report costs as its history grows, on both stores: the tenant's `--requests`
rows (money of 7 to 20 digits) and `--refusals` refusal-count rows (minutes x keys x reasons) spread over `--days`
days, then its report by day over the whole range on a read-only reader, as a report process runs it: summing every
row (as before day sums were kept), then with the closed days' sums kept (quotas/report_rollups.py): the first
report, the same asked again, and asked after a late row landed in a closed day. Wall time, this process's CPU
time and the PostgreSQL backend's (read from /proc: a server on this host; PostgreSQL sums in the server).

Each cell runs one ledger as a gateway replica does (one writer thread, group commits) and W concurrent
writers on one event loop, each recording a row and waiting until it is durable, as a request does before its
response ends (`submit` + `wait_durable`), for `--seconds`. Reported: rows/s, and the per-request latency of
that wait (p50 and p99): what the ledger adds to each answer. Stores, side by side in one run:
- sqlite normal: the default (commits reach the OS; survives a killed gateway);
- sqlite full: an fsync per group commit (survives a power cut);
- postgres: the fleet store on a server this benchmark starts on loopback (fsync on, synchronous_commit on:
  the WAL is flushed at each commit), or the one `--database-url` names. A real fleet's database is on
  another host: add a network round trip per group commit (not per row) to its latency.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import re
import statistics
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

from quotas.ledger import Ledger, LedgerRow
from quotas.ledger_postgres import PostgresLedger


def row() -> LedgerRow:
    return LedgerRow(request_id=uuid.uuid4().hex, ts=time.time(), tenant="acme", key_id="k", tier="mid", model="m",
                     status="ok", http_status=200, input_tokens=37, output_tokens=10, price_usd=Decimal("0.000057"),
                     compute_cost_usd=Decimal("0.0000012"), cost_basis="engine", ttft_s=0.01, total_s=0.05,
                     finish_reason="stop", route_reason="plan default", cache_status="miss")


async def measure(ledger: Ledger, writers: int, seconds: float) -> tuple[float, float, float]:
    """(rows/s, p50 ms, p99 ms) of W writers recording rows for `seconds`."""
    ledger.start()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def writer() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await ledger.wait_durable(ledger.submit(row()))
            latencies.append(time.perf_counter() - t0)

    await writer() if writers == 1 else None  # warm the connection and the page cache once
    latencies.clear()
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(writers)))
    elapsed = time.perf_counter() - t0
    ledger.close()
    q = statistics.quantiles(latencies, n=100)
    return len(latencies) / elapsed, q[49] * 1000, q[98] * 1000


async def claim_latencies(url: str, held: int, claims: int) -> tuple[list[float], list[float]]:
    """Seconds per `begin` of a new key with `held` live records of the tenant, then per refused one at its bound."""
    import psycopg

    from quotas.idempotency import MAX_RECORDS_PER_TENANT, Claim, Full
    from quotas.idempotency_postgres import PostgresIdempotency

    fill = ("INSERT INTO idempotency SELECT 'acme', 'held-' || g, 'fp', 'r', 'done', '{\"text\": \"hi\"}', 9e99 "
            "FROM generate_series(1, %s) AS g")
    store = PostgresIdempotency(url)  # its migrations first
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(fill, (held,))
        conn.execute("VACUUM ANALYZE")
    taken, refused = [], []
    for i in range(claims + 20):  # the first 20 warm the pool and the caches
        t0 = time.perf_counter()
        assert isinstance(await store.begin("acme", f"new-{i}", "fp", f"r{i}", lease_s=600), Claim)
        taken.append(time.perf_counter() - t0)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(fill.replace("'held-'", "'more-'"), (MAX_RECORDS_PER_TENANT - held - claims - 20,))
        conn.execute("VACUUM ANALYZE")
    for i in range(claims + 20):
        t0 = time.perf_counter()
        assert isinstance(await store.begin("acme", f"over-{i}", "fp", f"r{i}", lease_s=600), Full)
        refused.append(time.perf_counter() - t0)
    await store.close()
    return taken[20:], refused[20:]


def claims_main(args: argparse.Namespace, server: object) -> None:
    print(f"CPU: {cpu_model()}; PostgreSQL fsync on; {args.claims} claims a cell, one client")
    print("| tenant's live records | new key p50 (ms) | p99 (ms) | at its bound, refused p50 (ms) | p99 (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for held in (int(n) for n in args.held.split(",")):
        url = args.database_url or server.create_database()  # type: ignore[attr-defined]
        taken, refused = asyncio.run(claim_latencies(url, held, args.claims))
        cells = [q * 1000 for lat in (taken, refused) for q in (statistics.median(lat),
                                                                 statistics.quantiles(lat, n=100)[98])]
        print(f"| {held:,} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


def fill_history(ledger: Ledger, requests: int, refusals: int, days: int) -> None:
    """`requests` rows and `refusals` refusal-count rows of tenant "acme" over `days` days from 2026-01-01."""
    from quotas.ledger_rows import Refusal

    start, span, batch = 1_767_225_600, days * 86400, 20_000
    for first in range(0, requests, batch):
        rows = [LedgerRow(request_id=f"r{i}", ts=start + i * span / requests, tenant="acme", key_id=f"k{i % 7}",
                          tier=("small", "mid", "full")[i % 3], model="m", status="ok", http_status=200,
                          input_tokens=37 + i % 100, output_tokens=10 + i % 50,
                          price_usd=Decimal(f"0.{i % 9973:07d}{i % 13}"), compute_cost_usd=Decimal(f"0.00000{i % 97}1"),
                          cost_basis="engine", ttft_s=0.01, total_s=0.05, cache_status=("hit", "miss")[i % 2],
                          cache_saving_usd=Decimal(f"0.0000{i % 89}"), route_saving_usd=Decimal(i % 5) / 10**9)
                for i in range(first, min(first + batch, requests))]
        ledger.record_now(rows)
    minutes = days * 1440
    per_minute = max(1, refusals // minutes)  # distinct (key, reason) a minute
    keys = [(f"k{j % 7}", ("rate_limit_rpm", "rate_limit_tpm", "budget", "invalid_json")[j // 7 % 4])
            for j in range(per_minute)]
    for first in range(0, minutes, batch // per_minute or 1):
        ledger.record_now([], refusals=[Refusal(f"x{m}-{j}", start + m * 60, "acme", key, reason, 429)
                                        for m in range(first, min(first + batch // per_minute or 1, minutes))
                                        for j, (key, reason) in enumerate(keys)])


def server_cpu(reader: object) -> float | None:
    """CPU seconds the PostgreSQL backend serving `reader` has used (None: not PostgreSQL, or not on this host)."""
    if type(reader).__name__ != "PostgresReader":
        return None
    ((pid,),) = reader._query("SELECT pg_backend_pid()", ())  # type: ignore[attr-defined]
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def timed(reader: object, report: object) -> tuple[float, float, float | None, int]:
    """(wall s, CPU s of this process, CPU s of the database server or None, report rows) of one report."""
    server = server_cpu(reader)
    wall, cpu = time.perf_counter(), time.process_time()
    out = report()  # type: ignore[operator]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = server_cpu(reader)
    return wall, cpu, None if server is None or after is None else after - server, len(out)


def report_cost(source: object, late: object) -> list[tuple[str, tuple[float, float, float | None, int]]]:
    """One tenant's report by day: summing every row (median of 3), then with kept day sums as a report process
    keeps them (quotas/report_rollups.py): the first report, one asked again (median of 3), and one asked after
    `late()` added a row to a closed day (one day summed again)."""
    from quotas.ledger_reads import open_reader, store_identity
    from quotas.report import usage_report
    from quotas.report_rollups import DayRollups

    reader = open_reader(source)  # type: ignore[arg-type]
    query = {"by": ("tenant", "day"), "tenant": "acme"}
    kept = (DayRollups(), source, store_identity(source, reader))  # type: ignore[arg-type]

    def median(report: object) -> tuple[float, float, float | None, int]:
        return sorted((timed(reader, report) for _ in range(3)), key=lambda r: r[0])[1]

    runs = [("every row", median(lambda: usage_report(reader, **query))),  # type: ignore[arg-type]
            ("kept days: first", timed(reader, lambda: usage_report(reader, rollups=kept, **query))),  # type: ignore[arg-type]
            ("kept days: again", median(lambda: usage_report(reader, rollups=kept, **query)))]  # type: ignore[arg-type]
    late()  # type: ignore[operator]
    runs.append(("kept days: a late row", timed(reader, lambda: usage_report(reader, rollups=kept, **query))))  # type: ignore[arg-type]
    if usage_report(reader, rollups=kept, **query) != usage_report(reader, **query):  # type: ignore[arg-type]
        raise AssertionError("the report from kept days is not the one every row gives")
    reader.close()
    return runs


def reports_main(args: argparse.Namespace, server: object) -> None:
    counted = args.days * 1440 * max(1, args.refusals // (args.days * 1440))  # whole minutes' worth
    print(f"CPU: {cpu_model()}; one tenant: {args.requests:,} request rows, {counted:,} refusal-count rows, "
          f"{args.days} days; its report by day (medians of 3 where it says so)")
    print("| store | report | wall (s) | report process CPU (s) | database server CPU (s) | report rows |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or server.create_database()  # type: ignore[attr-defined]
        opens = (("sqlite", lambda: Ledger(Path(tmp) / "report.db")), ("postgres", lambda: PostgresLedger(url)))
        for name, open_ledger in opens:
            ledger = open_ledger()
            fill_history(ledger, args.requests, args.refusals, args.days)
            source = ledger.read_source()
            ledger.close()
            if name == "postgres":
                import psycopg

                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("VACUUM ANALYZE")

            def late(open_ledger: object = open_ledger) -> None:
                ledger = open_ledger()  # type: ignore[operator]
                ledger.record_now([row_at(1_767_225_600 + 5 * 86400 + 17)])
                ledger.close()

            for what, (wall, cpu, server_s, rows) in report_cost(source, late):
                on_server = "-" if server_s is None else f"{server_s:.2f}"
                print(f"| {name} | {what} | {wall:.3f} | {cpu:.3f} | {on_server} | {rows} |", flush=True)


def row_at(ts: float) -> LedgerRow:
    late = row()
    late.ts = ts
    return late


def cpu_model() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return f"{found[1] if found else platform.processor()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--writers", default="1,4,16")
    parser.add_argument("--database-url", default=None, help="an existing PostgreSQL (default: start one)")
    parser.add_argument("what", nargs="?", choices=("commits", "claims", "reports"), default="commits")
    parser.add_argument("--held", default="10,9000", help="claims: the tenant's live records before")
    parser.add_argument("--claims", type=int, default=500, help="claims: timed begins a cell")
    parser.add_argument("--requests", type=int, default=500_000, help="reports: the tenant's request rows")
    parser.add_argument("--refusals", type=int, default=1_000_000, help="reports: its refusal-count rows")
    parser.add_argument("--days", type=int, default=30, help="reports: the days they span")
    args = parser.parse_args()
    counts = [int(w) for w in args.writers.split(",")]
    logging.getLogger("tiergate.fleet_db").setLevel(logging.ERROR)  # not the migrations of each new database
    server = None
    if args.database_url is None:
        from tests.postgres import PostgresServer

        server = PostgresServer(fsync=True).start()
    try:
        if args.what in ("claims", "reports"):
            (claims_main if args.what == "claims" else reports_main)(args, server)
            return
        print(f"CPU: {cpu_model()}; {args.seconds:g} s per cell")
        print("| store | writers | rows/s | wait_durable p50 (ms) | p99 (ms) |")
        print("|---|---:|---:|---:|---:|")
        with tempfile.TemporaryDirectory() as tmp:
            for writers in counts:
                cells = [(f"sqlite {sync}", lambda sync=sync, w=writers: Ledger(Path(tmp) / f"{sync}-{w}.db",
                                                                                  sync=sync))
                         for sync in ("normal", "full")]
                cells.append(("postgres", lambda: PostgresLedger(
                    args.database_url or server.create_database())))  # type: ignore[union-attr]
                for name, open_ledger in cells:
                    rate, p50, p99 = asyncio.run(measure(open_ledger(), writers, args.seconds))
                    print(f"| {name} | {writers} | {rate:,.0f} | {p50:.2f} | {p99:.2f} |", flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
