"""Several processes committing to one SQLite ledger file, as `tiergate serve --workers N` does: commit latency as
the ledger committed before (SQLite's busy handler alone, its automatic checkpoints inside COMMIT) against now
(turns taken first, quotas/write_turns.py, and the ledger's own passive checkpoints every CHECKPOINT_EVERY commits,
outside the turn), side by side, alternating.

    .venv/bin/python -m bench.sqlite_writers                     # 2 writers, 4 s a cell, 2 rounds, 1 ms apart
    .venv/bin/python -m bench.sqlite_writers --writers 4 --gap-ms 0.2

Each writer commits a group of 8 ledger-sized rows in one transaction (BEGIN IMMEDIATE … COMMIT, WAL,
synchronous=NORMAL: the ledger's defaults), sleeps `--gap-ms`, and repeats; a commit's latency is from before it
asks for the lock to after COMMIT returns. No TIERGATE_* setting applies: the file is a temporary one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sqlite3
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from quotas.ledger_sqlite import CHECKPOINT_EVERY
from quotas.write_turns import WriteTurns

ROW = ("x" * 200,)  # about a ledger row's size


def _writer(path: str, turns: bool, seconds: float, gap_s: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    conn.execute("PRAGMA synchronous=NORMAL")
    lock = WriteTurns(Path(path)) if turns else None
    if turns:
        conn.execute("PRAGMA wal_autocheckpoint=0")
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        with lock.turn() if lock else nullcontext():
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT INTO t(v) VALUES (?)", [ROW] * 8)
            conn.execute("COMMIT")
        latencies.append(time.perf_counter() - started)
        if turns and len(latencies) % CHECKPOINT_EVERY == 0:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        time.sleep(gap_s)
    out.put(latencies)


def _cell(path: str, turns: bool, args: argparse.Namespace) -> list[float]:
    out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_writer, args=(path, turns, args.seconds, args.gap_ms / 1000, out))
             for _ in range(args.writers)]
    for p in procs:
        p.start()
    latencies = sorted(x for _ in procs for x in out.get())
    for p in procs:
        p.join()
    return latencies


def _at(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=int, default=2, help="processes committing at once [2]")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each cell [4]")
    p.add_argument("--rounds", type=int, default=2, help="cells per arm, the arms alternating [2]")
    p.add_argument("--gap-ms", type=float, default=1.0, help="each writer's pause between commits [1]")
    args = p.parse_args(argv)
    print("| round | arm | commits | p50 ms | p99 ms | p99.9 ms | max ms |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="tg-sqlite-writers-") as tmp:
        path = str(Path(tmp) / "ledger.db")
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
        for rnd in range(args.rounds):
            for turns in (False, True):
                ms = [x * 1000 for x in _cell(path, turns, args)]
                arm = "now: turns, own checkpoints" if turns else "before: busy handler, auto checkpoints"
                print(f"| {rnd + 1} | {arm} | {len(ms):,} | {_at(ms, 0.5):.3f} | {_at(ms, 0.99):.3f} | "
                      f"{_at(ms, 0.999):.3f} | {ms[-1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
