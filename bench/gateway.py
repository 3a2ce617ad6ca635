"""Gateway overhead (issue 18): Tiergate and LiteLLM's proxy in front of a mock upstream, side by side in one run.

    .venv/bin/python -m bench.gateway                       # the measurement: 10 s per cell, c = 1 / 16 / 64
    .venv/bin/python -m bench.gateway --quick               # a smoke run: 2 s per cell
    .venv/bin/python -m bench.gateway --compare-ref e0f0f18 --json /tmp/gateway.json
    .venv/bin/python -m bench.gateway --workers 2           # 1 and 2 gateway workers, cell by cell
    .venv/bin/python -m bench.gateway --workers 2 --rounds 3  # the same, three rounds: medians, every round's ratio

Only the gateway is timed: every tier points at bench/gateway_mock.py, an upstream many times faster than the
gateway (its own rate is measured in the same run and must be at least 5x the fastest gateway cell). The
gateway under test is pinned to one core (`--workers N`: N cores) with `taskset`; wrk, the mock and this
harness share the first core (the first few, up to 4, where the host has more CPUs than the workers need).
Tiergate runs as users run it (`python -m gateway.cli.main serve`, the embedded
SQLite ledger with its durable group commits and the memory quota backend, quotas and ledger on, a tenant and
key made through the admin API, every other TIERGATE_* setting taken from the environment). LiteLLM's proxy
runs from its own virtualenv (created under /tmp when missing), one model at the mock, no database.

Paths, each at every concurrency: (a) no cache: temperature unset, a new prompt per request; (b) exact cache
hit: one deterministic request, sent once before timing, then repeated; (c) deterministic and new each time:
temperature 0 and a new prompt per request (embed, search, store); (d) streaming: time to the first text
chunk and time per chunk, against the mock alone. wrk counts every answer's x-tiergate-cache header, so the
tables show that (a) bypassed the cache, (b) hit it and (c) missed it. Each cell also gives the target's CPU time
(user + system, all its processes) per answer: on a machine where other work runs, rates and latencies move with
that load, CPU per answer much less, so it is the figure to compare across targets there. `--compare-ref` runs the
reference commit beside this tree, both started at once and measured alternately, cell by cell.

`--workers N` (N > 1) measures scaling: Tiergate with 1 worker pinned to one core and with N workers
(`tiergate serve --workers N`) pinned to N cores, both on a redis-server of the run's own (on the load core: what
several workers share quotas, cache and ladder through), both running at once and measured alternately, cell by
cell, so that noise from other work on the machine falls on both; the report gives N workers over 1 per cell.
LiteLLM then runs with `--num_workers N`. On a machine with fewer than N + 1 CPUs the load generator shares the
gateway's first core, which the report says: such a run shows that the workers serve, not how they scale.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gateway_load import Cell, run_wrk, stream_probe
from bench.gateway_report import machine_info, render
from bench.gateway_targets import (
    OWNED_SETTINGS,
    REPO,
    Server,
    TargetUnavailable,
    head_label,
    ref_worktree,
    serve_supports_workers,
    settle,
    start_litellm,
    start_mock,
    start_redis,
    start_tiergate,
)

LOAD_CPUS = 4  # at most, for wrk, the mock, Redis and this harness, where the host has CPUs to spare
PROMPT = "Give one practical tip about @UNIQUE@ in a short sentence."
FIXED = "Give one practical tip about writing clear commit messages in a short sentence."


@dataclass(frozen=True)
class PathSpec:
    key: str
    title: str
    temperature: float | None
    unique: bool
    stream: bool = False
    prime: bool = False  # one request before timing, so that what follows can hit the cache
    cache_only: bool = False  # meaningful only for a gateway with an answer cache


PATHS = {p.key: p for p in (
    PathSpec("a", "(a) no cache: temperature unset, a new prompt per request", None, unique=True),
    PathSpec("b", "(b) exact cache hit: one deterministic request, repeated", 0.0, unique=False, prime=True,
             cache_only=True),
    PathSpec("c", "(c) deterministic, each request new: temperature 0, a new prompt (embed, search, store)", 0.0,
             unique=True),
    PathSpec("d", "(d) streaming: a new prompt per request, time to first text chunk and per chunk", None,
             unique=True, stream=True),
)}


def body_for(spec: PathSpec, model: str, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [
        {"role": "user", "content": PROMPT if spec.unique else FIXED}], "max_tokens": tokens}
    if spec.temperature is not None:
        body["temperature"] = spec.temperature
    if spec.stream:
        body["stream"] = True
    return body


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nonce = itertools.count(int(time.time()) % 1_000_000 * 1000)
        self.cells: list[Cell] = []
        self.load_servers: list[Server] = []  # the mock, Redis: their CPU counts as the load's

    def load_cpu_s(self) -> float:
        """CPU time the load side has used so far: this harness, its finished children (wrk), the load servers."""
        own, done = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return (own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
                + sum(s.cpu_s() for s in self.load_servers))

    def measure(self, server: Server, label: str, spec: PathSpec, concurrency: int, seconds: float) -> Cell:
        tokens = self.args.stream_tokens if spec.stream else self.args.tokens
        body = body_for(spec, self.args.model, tokens)
        cell = Cell(label, spec.key, concurrency, seconds)
        cpu_before, load_before, t0 = server.cpu_s(), self.load_cpu_s(), time.monotonic()
        if spec.stream:
            stream_probe(cell, server.host, server.port, "/v1/chat/completions", key=server.key, body=body,
                         nonce=next(self.nonce))
        else:
            run_wrk(cell, f"{server.url}/v1/chat/completions", key=server.key, body=body, unique=spec.unique,
                    nonce=next(self.nonce))
        cell.load_cores = (self.load_cpu_s() - load_before) / max(time.monotonic() - t0, 1e-9)
        settle(server)
        answered = cell.answers.get("2xx", 0)
        if answered:  # the health probes of `settle` are in it too: a few, against thousands of answers
            cell.cpu_ms_per_request = (server.cpu_s() - cpu_before) * 1000 / answered
        return cell

    def run_target(self, server: Server, label: str, paths: list[PathSpec]) -> None:
        self.run_alternating([(server, label)], paths)

    def run_alternating(self, targets: list[tuple[Server, str]], paths: list[PathSpec]) -> None:
        """Every path on every target, the targets taking turns cell by cell (one target: in order)."""
        for spec in paths:
            for server, label in targets:
                if spec.prime:
                    self.measure(server, label, spec, 1, 1)
                if self.args.warmup > 0:  # connections, the tokenizer, the embedder: loaded before timing
                    self.measure(server, label, spec, 16, self.args.warmup)
            for c in self.args.concurrency:
                for r in range(self.args.rounds):
                    for server, label in targets:
                        cell = self.measure(server, label, spec, c, self.args.seconds)
                        cell.round = r
                        self.cells.append(cell)
                        print(f"  {label:<28} {spec.key} c={c:<3} round {r + 1} {cell.rps:8.0f} req/s  "
                              f"p50 {cell.p50_ms or 0:7.2f} ms  p99 {cell.p99_ms or 0:8.2f} ms  errors {cell.errors}  "
                              f"{cell.answers}", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each timed cell [10]")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="untimed seconds per target and path before its cells (c=16) [2]")
    p.add_argument("--rounds", type=int, default=1,
                   help="cells per target, path and concurrency, the targets taking turns round by round; the "
                        "tables give each one's median, the ratio lines every round's [1]")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 s per cell, 1 s of warm-up")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64],
                   help="connections per cell, comma-separated [1,16,64]")
    p.add_argument("--paths", default="abcd", help="which paths to run, a subset of 'abcd' [abcd]")
    p.add_argument("--tokens", type=int, default=8, help="tokens per answer on paths a-c (max_tokens) [8]")
    p.add_argument("--stream-tokens", type=int, default=32, help="tokens per stream on path d [32]")
    p.add_argument("--model", default="auto", help="the request's model (Tiergate's `auto` routes; LiteLLM's model "
                                                   "list gets the same name) [auto]")
    p.add_argument("--workers", type=int, default=1,
                   help="gateway processes (`tiergate serve --workers N`, LiteLLM's --num_workers N), pinned to "
                        "N cores of their own; above 1, Tiergate also runs with 1 worker, alternating, both on a "
                        "redis-server of the run's own [1]")
    p.add_argument("--compare-ref", metavar="GIT_REV",
                   help="also run Tiergate at this commit (a temporary git worktree, removed afterwards), "
                        "both at once on the gateway's core, measured alternately cell by cell")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    p.add_argument("--litellm-venv", type=Path, default=Path("/tmp/litellm-venv"),
                   help="LiteLLM's own virtualenv, made with `pip install 'litellm[proxy]'` when missing "
                        "[/tmp/litellm-venv]")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write every cell's raw result here")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup = min(args.seconds, 2.0), min(args.warmup, 1.0)
    if not set(args.paths) <= set(PATHS) or not args.paths:
        p.error(f"--paths takes letters from 'abcd', got {args.paths!r}")
    if args.workers < 1 or args.rounds < 1 or any(c < 1 for c in args.concurrency):
        p.error("--workers, --rounds and --concurrency take positive numbers")
    if args.compare_ref and args.workers > 1:
        p.error("--compare-ref runs with one worker: leave out --workers (the scaling run has its own pair)")
    return args


def ensure_wrk() -> None:
    """wrk, installed with apt-get when missing (as root; else a message that says how)."""
    if shutil.which("wrk") is not None:
        return
    if os.geteuid() != 0:
        raise SystemExit("wrk is missing: install it with `sudo apt-get install -y wrk` (Debian's package)")
    print("installing wrk with apt-get (the benchmark's load generator; not a project dependency)", file=sys.stderr)
    if subprocess.run(["apt-get", "install", "-y", "-q", "wrk"]).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True)


def check_host(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The CPUs for load (wrk, mock, harness) and for the gateway; wrk installed when missing."""
    if not sys.platform.startswith("linux") or shutil.which("taskset") is None:
        raise SystemExit("bench.gateway pins processes with taskset: it runs on Linux only")
    ensure_wrk()
    if args.workers > 1 and not serve_supports_workers(REPO):
        raise SystemExit("--workers: `tiergate serve` has no --workers option in this tree yet (issue 18, item 3); "
                         "run without --workers")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < args.workers + 1:
        if args.workers == 1 or len(cpus) < args.workers:
            raise SystemExit(f"{args.workers} gateway worker(s) need {args.workers + 1} CPUs (one for the load "
                             f"generator and the mock); this process may use {len(cpus)}: {cpus}")
        print(f"only {len(cpus)} CPUs: the load generator shares CPU {cpus[0]} with the gateway's workers; this run "
              "shows that the workers serve, not how they scale", file=sys.stderr)
        return cpus[:1], cpus[1:] + cpus[:args.workers - len(cpus) + 1]  # 1 worker on a core of its own
    cores = physical_cores(cpus)
    return _split_cpus(cpus, cores, args.workers)


def _split_cpus(cpus: list[int], cores: list[list[int]], workers: int) -> tuple[list[int], list[int]]:
    """(load CPUs, gateway CPUs) from the usable `cpus` grouped into physical `cores`."""
    if len(cores) >= workers + 1 and len(cores) < len(cpus):
        # SMT: each worker gets a core of its own, its sibling threads left idle, so that N workers are N cores
        # (two threads of one core are about 1.2 cores, not 2); the load side takes the other cores, one thread of
        # each before any second thread, up to LOAD_CPUS
        load_cores = cores[:len(cores) - workers]
        threads = [core[i] for i in range(max(map(len, load_cores))) for core in load_cores if i < len(core)]
        return threads[:LOAD_CPUS], [core[0] for core in cores[len(cores) - workers:]]
    # the load side (wrk, the mock, Redis, this harness) takes what the workers leave, up to LOAD_CPUS, so that on
    # a larger host it cannot become what several workers wait on
    load = max(1, min(LOAD_CPUS, len(cpus) - workers))
    return cpus[:load], cpus[load:load + workers]


def physical_cores(cpus: list[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[list[int]]:
    """`cpus` grouped by the physical core they are threads of (Linux's sysfs topology), in the order of each core's
    first CPU; a CPU whose topology cannot be read is a core of its own."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def with_target(start: Callable[[], Server], skipped: dict[str, str], label: str,
                body: Callable[[Server], None]) -> None:
    try:
        server = start()
    except TargetUnavailable as exc:
        skipped[label] = str(exc).strip()
        print(f"{label}: skipped: {skipped[label][:2000]}", file=sys.stderr)
        return
    try:
        body(server)
    finally:
        server.stop()


def scaling(runner: Runner, label: str, work: Path, mock_url: str, gw_cpus: list[int], redis_url: str,
            skipped: dict[str, str], paths: list[PathSpec]) -> None:
    """Tiergate with 1 worker on one core and with N on N cores, one Redis (a database each), measured
    alternately."""
    n = len(gw_cpus)
    one, many = f"{label} 1 worker", f"{label} {n} workers"
    with_target(lambda: start_tiergate(one, REPO, work / "tiergate-1", mock_url, gw_cpus[:1], 1, f"{redis_url}/0"),
                skipped, one, lambda s1: with_target(
                    lambda: start_tiergate(many, REPO, work / f"tiergate-{n}", mock_url, gw_cpus, n, f"{redis_url}/1"),
                    skipped, many, lambda sn: runner.run_alternating([(s1, one), (sn, many)], paths)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_cpus, gw_cpus = check_host(args)
    os.sched_setaffinity(0, load_cpus)  # this harness, the mock and wrk (children inherit it)
    paths = [PATHS[k] for k in sorted(set(args.paths))]
    runner = Runner(args)
    skipped: dict[str, str] = {}
    overridden = sorted(k for k in OWNED_SETTINGS if k in os.environ)
    honoured = sorted(k for k in os.environ if k.startswith("TIERGATE_") and k not in OWNED_SETTINGS)
    info = machine_info(load_cpus, gw_cpus) | {"honoured_settings": honoured, "overridden_settings": overridden,
                                               "load_shares_gateway_cpu": bool(set(load_cpus) & set(gw_cpus))}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as name:
        work = Path(name)
        mock = start_mock(work / "mock", max(args.tokens, args.stream_tokens))
        try:
            print(f"mock upstream at {mock.url} (CPUs {load_cpus})", file=sys.stderr)
            runner.run_target(mock, "mock alone", [p for p in paths if not p.cache_only])
            runner.load_servers.append(mock)
            label = f"Tiergate {head_label()}"
            if args.workers > 1:
                redis = start_redis(work / "redis")
                runner.load_servers.append(redis)
                try:
                    scaling(runner, label, work, mock.url, gw_cpus, f"redis://127.0.0.1:{redis.port}", skipped, paths)
                finally:
                    redis.stop()
            elif args.compare_ref:  # both at once on the same core, taking turns cell by cell: noise falls on both
                with ref_worktree(args.compare_ref, work) as (tree, short):
                    ref_label = f"Tiergate @ {short} (ref)"
                    with_target(lambda: start_tiergate(label, REPO, work / "tiergate", mock.url, gw_cpus, 1),
                                skipped, label, lambda ours: with_target(
                                    lambda: start_tiergate(ref_label, tree, work / "ref", mock.url, gw_cpus, 1),
                                    skipped, ref_label, lambda ref: runner.run_alternating(
                                        [(ours, label), (ref, ref_label)], paths)))
            else:
                with_target(lambda: start_tiergate(label, REPO, work / "tiergate", mock.url, gw_cpus, 1),
                            skipped, label, lambda s: runner.run_target(s, label, paths))
            if not args.no_litellm:
                holder: dict[str, str] = {}

                def litellm() -> Server:
                    server = start_litellm(args.litellm_venv, work / "litellm", mock.url, gw_cpus, args.workers,
                                           args.model)
                    holder["label"] = server.name
                    return server

                with_target(litellm, skipped, "LiteLLM", lambda s: runner.run_target(
                    s, holder["label"], [p for p in paths if not p.cache_only]))
        finally:
            mock.stop()
    info["wall_s"] = round(time.time() - started, 1)
    info["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    command = "python -m bench.gateway " + " ".join(sys.argv[1:] if argv is None else argv)
    print(render(info, args, paths, runner.cells, skipped, command))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": info, "skipped": skipped,
                                         "paths": {p.key: p.title for p in paths},
                                         "cells": [c.as_dict() for c in runner.cells]}, indent=2))
        print(f"raw results: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
