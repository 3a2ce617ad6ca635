"""Two trees' gateways side by side, in process, at the same time on one CPU: CPU per request of a change.

    .venv/bin/python -m bench.gateway_inproc --ref d262770                     # paths a and b, c=16, 2 pairs
    .venv/bin/python -m bench.gateway_inproc --ref HEAD~1 --paths a --concurrency 1 --pairs 3
    .venv/bin/python -m bench.gateway_inproc --ref HEAD~1 --paths b --concurrency 1 --turns   # latency at c=1

On a machine where other work runs, `bench.gateway`'s cells move by 10-30% between runs with nothing changed, so a
change worth a few per cent of the gateway's CPU does not show through it. Here each tree's app (`create_app`, the
embedded stores, every tier pointed at one mock upstream, quotas, cache and ledger on, as `bench.gateway` runs it)
is driven over ASGI by a client in its own process (no uvicorn, no sockets on the client side: what is timed is the
app, the pipeline and the tier client), and both processes run at once, pinned to the same CPU, each timing its
own CPU (all its threads: the ledger writer's too) per request, round by round, the two starting each round
together. Whatever else the machine runs falls on both alike: two copies of one tree measured so agree within 2%
round by round (their rates move together by 2x with the machine's load), where alternating runs did not.

Paths as `bench.gateway`'s: (a) temperature unset, a new prompt per request (the cache is bypassed, the mock answers
8 tokens, streamed to the gateway as every tier call is); (b) one deterministic request, repeated (an exact cache
hit after the first); (c) temperature 0, a new prompt per request, worded as bench/gateway.lua words it (a counter
and six words of its list, the same sequence in both processes): a miss that embeds, searches and stores, its rounds
a few hundred requests (about 100 a second a core). `--ref` is extracted with `git archive` into a temporary
directory (no worktree).

The report gives each round's CPU µs per request for both, the medians and their ratio (ref over this tree: above
1 means this tree spends less); then the same for each round's p50 latency (the app's call to its return) and the
context switches a request (every thread's, voluntary and not). At c=1 two processes at once on one CPU wait on each
other, so their latencies are one figure: `--turns` runs their rounds one after the other instead (each first in
half of them), for latency, at the price of whatever else the machine runs falling on one more than the other.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXED = "Give one practical tip about writing clear commit messages in a short sentence."
WORDS = (  # bench/gateway.lua's
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
    "lantern", "meadow", "nectar", "obsidian", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet",
    "walnut", "xenon", "yarrow", "zephyr", "anchor", "bramble", "cobalt", "dune", "estuary", "falcon", "glacier",
    "hazel", "iris", "jasper", "kestrel", "lichen", "marble", "nettle", "orchid", "pylon", "quiver", "reef",
    "sorrel", "thistle", "urchin", "vortex", "willow", "yucca", "zinnia", "compiler", "tariff", "sonnet", "enzyme",
    "ledger", "piston", "opera", "satellite", "mortgage", "volcano", "algebra", "pastry", "voltage",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", default=None, help="the other tree: a commit of this repository [HEAD]")
    p.add_argument("--other", type=Path, default=None, help="the other tree: a directory (instead of --ref)")
    p.add_argument("--paths", default="ab", help="which paths, of a, b and c, e.g. ab or a,b [ab]")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight [16]")
    p.add_argument("--requests", type=int, default=2000, help="requests per round [2000]")
    p.add_argument("--rounds", type=int, default=4, help="rounds per path in one pair of processes [4]")
    p.add_argument("--pairs", type=int, default=2, help="pairs of processes, one after another [2]")
    p.add_argument("--tokens", type=int, default=8, help="tokens per answer [8]")
    p.add_argument("--turns", action="store_true",
                   help="the two take turns round by round instead of running at once: for latency (each round's "
                        "p50), which two processes on one CPU would share")
    p.add_argument("--child", nargs=2, metavar=("CONFIG_DIR", "CPU"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.paths = args.paths.replace(",", "")  # "a,b" ran a path "," too, timing whatever it fell through to
    if not args.paths or set(args.paths) - set("abc") or len(set(args.paths)) < len(args.paths):
        p.error(f"--paths: each of a, b and c at most once (e.g. ab or a,b), not {args.paths!r}")
    return args


# ---- the child: one tree's app, driven over ASGI -------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Runs with the tree under test as its working directory (its `gateway` is the one imported)."""
    config, cpu = args.child  # the tiers and plans the parent wrote (bench.gateway_targets' own)
    os.sched_setaffinity(0, {int(cpu)})
    work = Path(tempfile.mkdtemp(prefix="tiergate-inproc-"))
    tiers, plans = Path(config) / "tiers.yaml", Path(config) / "plans.yaml"
    os.environ.setdefault("TIERGATE_BUILD_MISSING_MODELS", "0")
    os.environ.setdefault("TIERGATE_MODELS_DIR", str(Path.home() / ".local" / "share" / "tiergate" / "models"))
    os.environ |= {"TIERGATE_DATA_DIR": str(work / "data"), "TIERGATE_TIERS_FILE": str(tiers),
                   "TIERGATE_PLANS_FILE": str(plans)}
    import logging

    logging.basicConfig(level=logging.WARNING)
    from gateway.app import create_app, load_config
    from gateway.bootstrap import ensure_bootstrap
    from gateway.settings import Settings
    from gateway.stores import open_tenant_store

    settings = Settings()
    store = open_tenant_store(settings)
    ensure_bootstrap(store, load_config(settings)[1], settings.data_dir)
    store.create_tenant("bench", "bench")
    _, key = store.issue_key("bench", name="bench")
    store.close()
    app = create_app(settings)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_drive(app, key, args))


async def _drive(app: Any, key: str, args: argparse.Namespace) -> None:
    startup: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                       startup.get, replies.put))
    started = await replies.get()
    if started["type"] != "lifespan.startup.complete":
        raise SystemExit(f"the app did not start: {started}")
    nonce = itertools.count(int(time.time()) % 100_000 * 100_000)
    words = random.Random(18)  # path c's texts: the same in both processes, new to each one's cache
    statuses: dict[int, int] = {}
    latencies: list[float] = []  # each request's wall time, from the app's call to its return

    def body(path: str) -> bytes:
        if path == "a":
            question = f"Give one practical tip about {next(nonce)} in a short sentence."
            return json.dumps({"model": "auto", "max_tokens": args.tokens,
                               "messages": [{"role": "user", "content": question}]}).encode()
        if path == "c":
            question = (f"Give one practical tip about ask {next(nonce)}-1-1: "
                        f"{' '.join(words.choice(WORDS) for _ in range(6))} in a short sentence.")
            return json.dumps({"model": "auto", "max_tokens": args.tokens, "temperature": 0,
                               "messages": [{"role": "user", "content": question}]}).encode()
        return json.dumps({"model": "auto", "max_tokens": args.tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": FIXED}]}).encode()

    async def one(path: str) -> None:
        data = body(path)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1:8080"), (b"authorization", f"Bearer {key}".encode()),
                             (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080), "state": {}}
        answered = asyncio.Event()
        sent = False
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        t0 = time.perf_counter()
        await app(scope, receive, send)
        latencies.append(time.perf_counter() - t0)
        answered.set()
        statuses[status] = statuses.get(status, 0) + 1

    async def run(path: str, count: int) -> None:
        left = iter(range(count))

        async def client() -> None:
            for _ in left:
                await one(path)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))

    for path in args.paths:
        await run(path, 500)  # warm-up (and path b's first answer, kept by the cache)
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    for path in args.paths:
        for _ in range(args.rounds):
            await loop.run_in_executor(None, sys.stdin.readline)  # the parent starts both processes' rounds together
            statuses.clear()
            latencies.clear()
            cpu0, t0, ru0 = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            await run(path, args.requests)
            cpu_us = (time.process_time() - cpu0) * 1e6 / args.requests
            ru1 = resource.getrusage(resource.RUSAGE_SELF)  # context switches of all its threads
            switches = (ru1.ru_nvcsw - ru0.ru_nvcsw + ru1.ru_nivcsw - ru0.ru_nivcsw) / args.requests
            print(json.dumps({"path": path, "cpu_us": round(cpu_us, 1),
                              "rps": round(args.requests / (time.perf_counter() - t0)),
                              "p50_us": round(statistics.median(latencies) * 1e6, 1),
                              "switches": round(switches, 2), "statuses": statuses}),
                  flush=True)
    await startup.put({"type": "lifespan.shutdown"})
    await replies.get()
    await lifespan


# ---- the parent: two children at once, rounds started together ---------------------------------------------------


def spawn_child(tree: Path, config: Path, cpu: int, args: argparse.Namespace, log: Path) -> subprocess.Popen[str]:
    argv = ["--child", str(config), str(cpu), "--paths", args.paths, "--concurrency", str(args.concurrency),
            "--requests", str(args.requests), "--rounds", str(args.rounds), "--tokens", str(args.tokens)]
    # run from `tree` (its packages imported, `-c` puts the working directory first on sys.path), with this file's
    # child code, which the other tree may not have
    code = (f"import runpy, sys; sys.argv = ['gateway_inproc', *{argv!r}]; "
            f"runpy.run_path({str(Path(__file__))!r}, run_name='__main__')")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=tree, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def read_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    tail = proc.log.read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
    raise SystemExit(f"a child process ended early (exit {proc.wait()}):\n{tail}")


def extract(ref: str, parent: Path) -> tuple[Path, str]:
    commit = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    tree = parent / f"ref-{commit}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree, commit


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    from bench.gateway_report import machine_info
    from bench.gateway_targets import head_label, start_mock, write_bench_config

    cpus = sorted(os.sched_getaffinity(0))
    load, gw = cpus[0], cpus[-1]
    os.sched_setaffinity(0, {load})
    info = machine_info([load], [gw])
    with tempfile.TemporaryDirectory(prefix="tiergate-inproc-") as tmp:
        if args.other is not None:
            other, other_label = args.other.resolve(), str(args.other)
        else:
            other, other_label = extract(args.ref or "HEAD", Path(tmp))
        mine = head_label() or REPO.name
        mock = start_mock(Path(tmp), args.tokens)
        config = Path(tmp) / "config"
        write_bench_config(config, mock.url)
        results: dict[str, dict[str, list[float]]] = {p: {"this": [], "other": []} for p in args.paths}
        p50s: dict[str, dict[str, list[float]]] = {p: {"this": [], "other": []} for p in args.paths}
        switches: dict[str, dict[str, list[float]]] = {p: {"this": [], "other": []} for p in args.paths}
        try:
            for pair in range(args.pairs):
                procs = {"this": spawn_child(REPO, config, gw, args, Path(tmp) / f"this-{pair}.log"),
                         "other": spawn_child(other, config, gw, args, Path(tmp) / f"other-{pair}.log")}
                try:
                    for proc in procs.values():
                        read_json(proc)  # ready
                    for path in args.paths:
                        for turn in range(args.rounds):
                            got = {}
                            order = list(procs.items())  # each goes first in half the rounds
                            for name, proc in order[::-1] if turn % 2 else order:
                                assert proc.stdin is not None
                                proc.stdin.write("go\n")
                                proc.stdin.flush()
                                if args.turns:
                                    got[name] = read_json(proc)
                            got = got or {name: read_json(proc) for name, proc in procs.items()}
                            for name, row in got.items():
                                bad = {s: n for s, n in row["statuses"].items() if s != "200"}
                                if bad:
                                    raise SystemExit(f"{name} answered {bad} (path {path})")
                                results[path][name].append(row["cpu_us"])
                                p50s[path][name].append(row.get("p50_us", math.nan))
                                switches[path][name].append(row.get("switches", math.nan))
                            print(f"pair {pair + 1} path {path}: this {got['this']['cpu_us']:.0f} µs "
                                  f"({got['this']['rps']} req/s), other {got['other']['cpu_us']:.0f} µs "
                                  f"({got['other']['rps']} req/s)", file=sys.stderr, flush=True)
                finally:
                    for proc in procs.values():
                        proc.wait(timeout=120)
        finally:
            mock.stop()
    print(f"`python -m bench.gateway_inproc {' '.join(sys.argv[1:] if argv is None else argv)}` — {info['date']}; "
          f"CPU: {info['cpu']}, both on CPU {gw}, the mock on CPU {load}; load average {info['loadavg_at_start']} at "
          f"the start, {round(os.getloadavg()[0], 2)} at the end\n")
    tables = (("CPU µs/request", results, 0), ("p50 µs/request", p50s, 0), ("context switches/request", switches, 2))
    for n, (what, table, digits) in enumerate(tables):
        gap = "\n" if n else ""  # a blank line between tables
        print(f"{gap}| path | c | {mine}: {what}, each round | {other_label}: each round | medians | "
              f"{other_label} over {mine} |\n|---|---|---|---|---|---|")
        for path in args.paths:
            this, ref = table[path]["this"], table[path]["other"]
            a, b = statistics.median(this), statistics.median(ref)
            print(f"| ({path}) | {args.concurrency} | {', '.join(f'{x:.{digits}f}' for x in this)} | "
                  f"{', '.join(f'{x:.{digits}f}' for x in ref)} | {a:.{digits}f} / {b:.{digits}f} | "
                  f"{b / a:.3f}x |")


if __name__ == "__main__":
    main()
