"""CPU per answer of one gateway worker against two, user and system apart (`tiergate serve --workers`, issue 18).

    .venv/bin/python -m bench.worker_cpu                    # path a (no cache), c=64, 12 s a cell, 2 rounds
    .venv/bin/python -m bench.worker_cpu --path b --rounds 3

Both on a redis-server of the run's own (as bench/gateway.py's `--workers` runs them), every tier on the mock,
the load (wrk, the mock, Redis) on the first CPU; one worker on the second, two on both. Each cell reads the user and
system CPU time of every process of the target (the parent and its workers) before and after, over the answers:
what bench/gateway.py's "CPU ms/req" gives as one figure. Every TIERGATE_* setting but those the harness owns is
honoured.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import psutil

from bench.gateway import PATHS, body_for
from bench.gateway_load import Cell, run_wrk
from bench.gateway_targets import REPO, start_mock, start_redis, start_tiergate


def cpu_times(root: psutil.Process) -> tuple[float, float]:
    user = system = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        user, system = user + t.user, system + t.system
    return user, system


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", choices=["a", "b"], default="a", help="bench/gateway.py's path [a]")
    p.add_argument("--concurrency", type=int, default=64, help="wrk's connections [64]")
    p.add_argument("--seconds", type=float, default=12.0, help="length of each cell [12]")
    p.add_argument("--rounds", type=int, default=2, help="cells per target, the targets alternating [2]")
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs 2 CPUs: the load on one, the workers on the other and beside it")
    os.sched_setaffinity(0, {cpus[0]})
    spec = PATHS[args.path]
    body = body_for(spec, "auto", 8)

    with tempfile.TemporaryDirectory(prefix="tg-worker-cpu-") as name:
        work = Path(name)
        mock, redis = start_mock(work / "mock", 8), start_redis(work / "redis")
        servers = []
        try:
            for n, pinned in ((1, cpus[1:2]), (2, cpus[:2])):
                servers.append((n, start_tiergate(f"{n} worker(s)", REPO, work / f"tg{n}", mock.url, pinned, n,
                                                  f"redis://127.0.0.1:{redis.port}/{n}")))
            for _, s in servers:  # warm-up; a prime for path b
                run_wrk(Cell("warm", spec.key, 16, 3.0), f"{s.url}/v1/chat/completions", key=s.key, body=body,
                        unique=spec.unique, nonce=0)
            print("| round | workers | req/s | user ms / answer | system ms / answer |\n|---|---|---|---|---|")
            for rnd in range(args.rounds):
                for n, s in servers:
                    root = psutil.Process(s.proc.pid)
                    before = cpu_times(root)
                    cell = run_wrk(Cell(s.name, spec.key, args.concurrency, args.seconds),
                                   f"{s.url}/v1/chat/completions", key=s.key, body=body, unique=spec.unique,
                                   nonce=rnd + 1)
                    after = cpu_times(root)
                    answers = max(1, cell.answers.get("2xx", 0))
                    print(f"| {rnd + 1} | {n} | {cell.rps:,.0f} | {1000 * (after[0] - before[0]) / answers:.3f} | "
                          f"{1000 * (after[1] - before[1]) / answers:.3f} |", flush=True)
        finally:
            for _, s in servers:
                s.stop()
            redis.stop()
            mock.stop()


if __name__ == "__main__":
    main()
