"""Where the gateway's time goes on one path of bench/gateway.py: py-spy samples of the running `tiergate serve`.

    .venv/bin/python -m bench.gateway_profile                      # path a (no cache), c=16, 10 s
    .venv/bin/python -m bench.gateway_profile --path b --top 40    # exact cache hits
    .venv/bin/python -m bench.gateway_profile --raw /tmp/a.txt     # also keep py-spy's raw stacks (flamegraph.pl)

The gateway is started as bench/gateway.py starts it (every tier pointed at its mock upstream, the embedded stores,
pinned to the last CPU; wrk and the mock on the first), warmed up, measured once without the profiler (requests a
second and CPU per answer), then sampled by `py-spy record --nonblocking` over a second cell of the same length.
The report lists functions by the share of samples they were running in (self) and, for this project's functions,
under (inclusive), so that a change to the hot path can be checked against what it was meant to cut. py-spy
samples every thread; a coroutine suspended in the middle of a chain shows as a partial stack, which is why
inclusive shares stay below 100%.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.gateway import PATHS, body_for, ensure_wrk
from bench.gateway_load import Cell, run_wrk
from bench.gateway_report import machine_info
from bench.gateway_targets import REPO, start_mock, start_redis, start_tiergate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", choices=["a", "b", "c"], default="a", help="which of bench/gateway.py's paths [a]")
    p.add_argument("--concurrency", type=int, default=16, help="wrk's connections [16]")
    p.add_argument("--seconds", type=int, default=10, help="length of the measured and of the sampled cell [10]")
    p.add_argument("--tokens", type=int, default=8, help="tokens per answer [8]")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples a second [500]")
    p.add_argument("--top", type=int, default=30, help="functions listed per table [30]")
    p.add_argument("--raw", type=Path, help="also keep py-spy's raw stacks here")
    p.add_argument("--redis", action="store_true",
                   help="quotas, cache and ladder on a redis-server of the run's own (on the load CPU), as "
                        "`tiergate serve --workers N` runs them; default: the embedded stores")
    return p.parse_args(argv)


def function_of(frame: str) -> str:
    """`name (file.py:LINE)` -> `name (file.py)`: a function's lines counted together."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


PROJECT = ("gateway/", "tiers/", "quotas/", "cache/", "wire/", "assets/")


def is_ours(function: str) -> bool:
    """A function of the request path in this project (the CLI's entry frames, on every stack, left out)."""
    where = function.rpartition(" (")[2]
    return where.startswith(PROJECT) and not where.startswith("gateway/cli/")


def shares(raw: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Samples in all, and per function: samples it was running in, samples it was on the stack of."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [function_of(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    return total, own, under


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("py-spy is not installed: `.venv/bin/pip install py-spy`")
    ensure_wrk()
    cpus = sorted(os.sched_getaffinity(0))
    load, gw = [cpus[0]], [cpus[-1]]
    os.sched_setaffinity(0, set(load))
    info = machine_info(load, gw)
    work = Path(tempfile.mkdtemp(prefix="tiergate-profile-"))
    spec = PATHS[args.path]
    body = body_for(spec, "auto", args.tokens)
    nonce = itertools.count(int(time.time()) % 1_000_000 * 1000)
    mock = start_mock(work, args.tokens)
    redis = start_redis(work) if args.redis else None
    try:
        tg = start_tiergate("Tiergate", REPO, work / "tiergate", mock.url, gw, 1,
                            redis_url=f"redis://127.0.0.1:{redis.port}/0" if redis is not None else None)
        try:
            url = f"{tg.url}/v1/chat/completions"
            if spec.prime:
                run_wrk(Cell("prime", args.path, 1, 1), url, key=tg.key, body=body, unique=False, nonce=next(nonce))
            run_wrk(Cell("warm", args.path, 16, 3), url, key=tg.key, body=body, unique=spec.unique, nonce=next(nonce))
            cpu0 = tg.cpu_s()
            plain = run_wrk(Cell("plain", args.path, args.concurrency, args.seconds), url, key=tg.key, body=body,
                            unique=spec.unique, nonce=next(nonce))
            answered = max(1, plain.answers.get("2xx", 0))
            cpu_ms = (tg.cpu_s() - cpu0) * 1000 / answered
            raw = args.raw or work / "pyspy.txt"
            sampler = subprocess.Popen([spy, "record", "--pid", str(tg.proc.pid), "--format", "raw", "--nonblocking",
                                        "--rate", str(args.rate), "--duration", str(args.seconds), "--output",
                                        str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            sampled = run_wrk(Cell("sampled", args.path, args.concurrency, args.seconds), url, key=tg.key,
                              body=body, unique=spec.unique, nonce=next(nonce))
            sampler.wait(timeout=args.seconds + 60)
        finally:
            tg.stop()
    finally:
        mock.stop()
        if redis is not None:
            redis.stop()
    total, own, under = shares(raw)
    print(f"# Profile of path {spec.title}\n")
    print(f"`python -m bench.gateway_profile {' '.join(sys.argv[1:] if argv is None else argv)}` — {info['date']}; "
          f"CPU: {info['cpu']} ({os.cpu_count()} online), gateway on CPU {gw[0]}, wrk and the mock on CPU {load[0]}; "
          f"load average {info['loadavg_at_start']} at the start\n")
    print(f"- without the profiler: {plain.rps:,.0f} req/s at c={args.concurrency}, "
          f"{cpu_ms:.2f} ms CPU per answer ({answered} answers)")
    print(f"- sampled: {sampled.rps:,.0f} req/s, {total} samples at {args.rate}/s\n")
    ours = Counter({name: n for name, n in under.items() if is_ours(name)})
    for title, counts in (("running in (self)", own), ("on the stack of (inclusive; this project's code)", ours)):
        print(f"| share of samples {title} | function |\n|---|---|")
        for name, n in counts.most_common(args.top):
            print(f"| {100 * n / max(1, total):.1f}% | `{name}` |")
        print()


if __name__ == "__main__":
    main()
