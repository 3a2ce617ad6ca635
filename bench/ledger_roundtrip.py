"""The usage ledger's round trip, one row at a time: `submit`, then `wait_durable` until the writer thread's commit.

    .venv/bin/python -m bench.ledger_roundtrip --ref b30cd71            # this tree against a commit, taking turns
    .venv/bin/python -m bench.ledger_roundtrip --ref b30cd71 --runs 9 --rows 2000 --cpu 1

At one request at a time every JSON answer waits for this (the row-before-response promise), so it is part of the
added p50 at c=1 (issue 18). Each run is a fresh process (uvloop, an embedded SQLite ledger in a temporary directory,
pinned to `--cpu` with its writer thread, as the gateway is in bench/gateway.py): 300 rows to warm up, then `--rows`
rows one after another. The two trees' runs take turns; the report gives each run's p50 µs a row, CPU µs a row (both
threads) and context switches a row (voluntary and not), and their medians. `--ref` is extracted with `git archive`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import asyncio, resource, sys, tempfile, time, uuid
from decimal import Decimal
from pathlib import Path
import uvloop
from quotas.ledger import Ledger
from quotas.ledger_rows import LedgerRow

def row():
    return LedgerRow(uuid.uuid4().hex, time.time(), "t", "k", "mid", "m", "ok", 200, 10, 8, Decimal("0.0001"),
                     Decimal("0.00002"), "wall", 0.001, 0.002)

async def main(n):
    ledger = Ledger(Path(tempfile.mkdtemp()) / "ledger.db")
    ledger.start()
    for _ in range(300):
        await ledger.wait_durable(ledger.submit(row()))
    took = []
    ru0, cpu0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await ledger.wait_durable(ledger.submit(row()))
        took.append(time.perf_counter() - t0)
        await asyncio.sleep(0)
    cpu, ru1 = time.process_time() - cpu0, resource.getrusage(resource.RUSAGE_SELF)
    switches = ru1.ru_nvcsw - ru0.ru_nvcsw + ru1.ru_nivcsw - ru0.ru_nivcsw
    print(sorted(took)[n // 2] * 1e6, cpu / n * 1e6, switches / n)
    ledger.close()

uvloop.install()
asyncio.run(main(int(sys.argv[1])))
"""


def run_once(tree: Path, rows: int, cpu: int) -> tuple[float, float, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", CHILD, str(rows)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    p50, cpu_us, switches = (float(x) for x in out[-3:])
    return p50, cpu_us, switches


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", default="HEAD", help="the other tree: a commit of this repository [HEAD]")
    p.add_argument("--runs", type=int, default=7, help="runs of each tree, taking turns [7]")
    p.add_argument("--rows", type=int, default=1500, help="rows a run [1500]")
    p.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)), help="the CPU [the last]")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tiergate-ledger-rt-") as tmp:
        other = Path(tmp) / "ref"
        other.mkdir()
        archive = subprocess.run(["git", "archive", args.ref], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(other)], input=archive, check=True)
        got: dict[str, list[tuple[float, float, float]]] = {"this": [], args.ref: []}
        for i in range(args.runs):
            order = [("this", REPO), (args.ref, other)]
            for name, tree in order[::-1] if i % 2 else order:
                got[name].append(run_once(tree, args.rows, args.cpu))
    print(f"`python -m bench.ledger_roundtrip {' '.join(sys.argv[1:] if argv is None else argv)}`, CPU {args.cpu}, "
          f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print("| tree | p50 µs a row, each run | median | CPU µs a row | switches a row |\n|---|---|---|---|---|")
    for name, runs in got.items():
        print(f"| {name} | {', '.join(f'{r[0]:.0f}' for r in runs)} | {statistics.median(r[0] for r in runs):.0f} | "
              f"{statistics.median(r[1] for r in runs):.0f} | {statistics.median(r[2] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
