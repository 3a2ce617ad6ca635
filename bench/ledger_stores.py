"""Ledger commit throughput and the latency it adds to a request: SQLite (embedded) vs PostgreSQL (a fleet).

    .venv/bin/python -m bench.ledger_stores [--seconds 3] [--writers 1,4,16] [--database-url postgresql://…]

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
    args = parser.parse_args()
    counts = [int(w) for w in args.writers.split(",")]
    logging.getLogger("tiergate.fleet_db").setLevel(logging.ERROR)  # not the migrations of each new database
    server = None
    if args.database_url is None:
        from tests.postgres import PostgresServer

        server = PostgresServer(fsync=True).start()
    try:
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
