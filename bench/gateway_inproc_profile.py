"""Where one path's CPU goes in bench.gateway_inproc's in-process harness: a SIGPROF sampler over its timed rounds.

    .venv/bin/python -m bench.gateway_inproc_profile --path b               # exact hits, c=16, 3000 requests
    .venv/bin/python -m bench.gateway_inproc_profile --path a --top 60 --under 'choose (gateway/pipeline/route'

This tree's app is driven as bench.gateway_inproc drives it (its child, every tier at one mock upstream, quotas, cache
and ledger on), alone, one round of `--requests`; the process's CPU timer (ITIMER_PROF, all its threads' CPU) stops
the event loop's thread every `--interval-ms` of CPU and its Python stack is counted, from the round's start to its
end (the warm-up is not sampled). Unlike bench/gateway_profile.py (py-spy on a served gateway, wall clock), what is
counted is CPU spent, and unlike cProfile it costs the code nothing between samples, so shares of inclusive time
hold for coroutines too (a coroutine's stack is whole while it runs); a dataclass's generated `__init__` is named by
its class. The writer threads' own CPU ends up in whatever
the loop's thread runs when the timer fires. The report: functions by share of samples they were running in (self)
and under (inclusive); `--under PREFIX`: what the first function whose name starts with PREFIX spends its share on.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
Stack = tuple[str, ...]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_inproc_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", choices=["a", "b", "c"], default="b", help="bench.gateway_inproc's path [b]")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight [16]")
    p.add_argument("--requests", type=int, default=3000, help="requests in the sampled round [3000]")
    p.add_argument("--interval-ms", type=float, default=0.5, help="CPU between samples, ms [0.5]")
    p.add_argument("--top", type=int, default=50, help="functions listed per table [50]")
    p.add_argument("--under", action="append", default=[], help="a function's name (a prefix of it as listed)")
    p.add_argument("--keep", type=Path, help="also keep the counted stacks here (a pickle of {stack: samples})")
    p.add_argument("--child", nargs=2, metavar=("CONFIG_DIR", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def frame_name(frame: FrameType) -> str:
    code = frame.f_code
    if code.co_filename == "<string>" and code.co_varnames[:1] == ("self",):  # a dataclass's generated method: the
        # same `__init__ (<string>:2)` for every class, so named by its class
        return f"{type(frame.f_locals['self']).__name__}.{code.co_name} (<string>)"
    return f"{code.co_name} ({code.co_filename.removeprefix(str(REPO) + '/')}:{code.co_firstlineno})"


class Sampler:
    """Counts the main thread's Python stack at each SIGPROF, once armed (at the first round's start)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.stacks: collections.Counter[Stack] = collections.Counter()

    def install(self) -> None:
        """The handler (from the main thread, as Python requires); the timer starts at `arm`, from any thread."""
        signal.signal(signal.SIGPROF, self._sample)

    def arm(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)

    def _sample(self, _sig: int, frame: FrameType | None) -> None:
        names = []
        while frame is not None:
            names.append(frame_name(frame))
            frame = frame.f_back
        self.stacks[tuple(reversed(names))] += 1


class ArmingStdin:
    """bench.gateway_inproc's child reads a line from stdin (in an executor thread) before each round: it arms the
    sampler, and the round's result line on stdout (its end) disarms it."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def readline(self) -> str:
        self.sampler.arm()
        return "go\n"


class DisarmingStdout:
    def __init__(self, sampler: Sampler, out: Any) -> None:
        self.sampler, self.out = sampler, out

    def write(self, text: str) -> int:
        if '"cpu_us"' in text:
            self.sampler.disarm()
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def child(args: argparse.Namespace) -> None:
    """Runs with this tree as its working directory: bench.gateway_inproc's child, one round, sampled."""
    config, out = args.child
    sampler = Sampler(args.interval_ms / 1000)
    sampler.install()
    sys.stdin = ArmingStdin(sampler)  # type: ignore[assignment]
    sys.stdout = DisarmingStdout(sampler, sys.stdout)  # type: ignore[assignment]
    cpu = sorted(os.sched_getaffinity(0))[-1]
    sys.argv = ["gateway_inproc", "--child", config, str(cpu), "--paths", args.path, "--concurrency",
                str(args.concurrency), "--requests", str(args.requests), "--rounds", "1"]
    runpy.run_path(str(REPO / "bench" / "gateway_inproc.py"), run_name="__main__")
    sampler.disarm()
    Path(out).write_bytes(pickle.dumps(dict(sampler.stacks)))


def report(stacks: dict[Stack, int], top: int, under: list[str]) -> None:
    total = sum(stacks.values()) or 1
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        own[stack[-1]] += n
        for name in set(stack):
            inclusive[name] += n
    print(f"{total} samples\n\n| under | self | function |\n|---|---|---|")
    shown = [(name, n) for name, n in inclusive.most_common() if n < total]  # not the harness's own frames
    for name, n in shown[:top]:
        print(f"| {100 * n / total:.1f}% | {100 * own[name] / total:.1f}% | {name} |")
    print("\n| self | function |\n|---|---|")
    for name, n in own.most_common(top):
        print(f"| {100 * n / total:.1f}% | {name} |")
    for prefix in under:
        spent: collections.Counter[str] = collections.Counter()
        for stack, n in stacks.items():
            at = next((i for i, name in enumerate(stack) if name.startswith(prefix)), None)
            if at is not None:
                spent[stack[at + 1] if at + 1 < len(stack) else "(itself)"] += n
        print(f"\n{prefix}: {100 * sum(spent.values()) / total:.1f}%\n\n| share | in |\n|---|---|")
        for name, n in spent.most_common(top):
            print(f"| {100 * n / total:.1f}% | {name} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    from bench.gateway_targets import start_mock, write_bench_config

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # the mock on the first CPU, the app on the last (the child pins itself)
    with tempfile.TemporaryDirectory(prefix="tiergate-inproc-profile-") as tmp:
        mock = start_mock(Path(tmp), 8)
        config, out = Path(tmp) / "config", Path(tmp) / "stacks.pickle"
        write_bench_config(config, mock.url)
        try:
            argv_child = ["--child", str(config), str(out), "--path", args.path, "--concurrency",
                          str(args.concurrency), "--requests", str(args.requests), "--interval-ms",
                          str(args.interval_ms)]
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            done = subprocess.run([sys.executable, "-m", "bench.gateway_inproc_profile", *argv_child], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, text=True)
            rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"path"')]
            if done.returncode != 0 or not rows:
                raise SystemExit(f"the child failed (exit {done.returncode})")
        finally:
            mock.stop()
        stacks = pickle.loads(out.read_bytes())
    if args.keep is not None:
        args.keep.write_bytes(pickle.dumps(stacks))
    row = rows[0]
    print(f"`python -m bench.gateway_inproc_profile {shlex.join(sys.argv[1:] if argv is None else argv)}`: path "
          f"{args.path}, c={args.concurrency}, {args.requests} requests, {row['cpu_us']} µs CPU a request "
          f"(sampled), statuses {row['statuses']}\n")
    report(stacks, args.top, args.under)


if __name__ == "__main__":
    main()
