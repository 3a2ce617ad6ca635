"""What the gateway's Redis client costs per request: the quota backend's reserve + settle, client CPU only.

    .venv/bin/python -m bench.redis_client                        # 5 rounds of 1,000 reserve + settle pairs
    .venv/bin/python -m bench.redis_client --rounds 9 --calls 2000

Every request a worker of `tiergate serve --workers N` answers reserves its quota in Redis and settles it there
(quotas/backends/redis.py: two Lua scripts, 30 arguments for a tenant and a key). This times that pair through
`RedisBackend` on a redis-server of the run's own, with each of redis-py's response parsers, side by side in one
process: the pure-Python RESP3 parser and hiredis' C parser (what redis-py picks when `hiredis` is installed).
Backends take turns round by round, so other work on the machine falls on both. Reported: CPU time of this
process (user + system, `time.process_time`) per pair, median and range of the rounds, so the figure leaves
out Redis' own time running the scripts (see `--server`, which reports that from Redis' INFO commandstats).
Pin it to one CPU (`taskset -c 1`) for steadier figures; redis-server runs wherever this process may.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser
from redis.utils import HIREDIS_AVAILABLE

from bench.gateway_report import machine_info
from bench.gateway_targets import start_redis
from quotas.backends.base import ReservationRequest
from quotas.backends.redis import RedisBackend
from quotas.limits import ScopeLimits

PARSERS = {"python (RESP3)": _AsyncRESP3Parser, "hiredis": _AsyncHiredisParser}
# a tenant with every limit set and one key with a rate limit: the scopes an ordinary request is checked in
SCOPES = (ScopeLimits("t", rpm=10**9, tpm=10**12, max_concurrent=10**6, budget_day_pico=10**18,
                      budget_month_pico=10**19), ScopeLimits("k:bench", rpm=10**9))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.redis_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds per parser, taking turns [5]")
    p.add_argument("--calls", type=int, default=1000, help="reserve + settle pairs per round [1000]")
    p.add_argument("--server", action="store_true", help="also report Redis' own time per script call")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls take positive numbers")
    return args


async def pairs(backend: RedisBackend, n: int, ids: itertools.count[int]) -> float:
    """CPU µs of this process per reserve + settle, over n of them."""
    t0 = time.process_time()
    for _ in range(n):
        req = ReservationRequest(f"bench-{next(ids)}", "bench", SCOPES, tokens=100, money_pico=1000)
        await backend.reserve(req)
        await backend.settle(req, tokens=50, money_pico=500)
    return (time.process_time() - t0) / n * 1e6


async def run(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    ids = itertools.count()
    backends = {}
    for name, parser in PARSERS.items():
        backend = RedisBackend(url)
        backend.redis.connection_pool.connection_kwargs["parser_class"] = parser
        await pairs(backend, min(200, args.calls), ids)  # connections opened, scripts loaded
        conn = await backend.redis.connection_pool.get_connection()
        used = type(conn._parser)
        await backend.redis.connection_pool.release(conn)
        if used is not parser:  # redis-py ignored the choice: the comparison would be of one parser with itself
            raise SystemExit(f"{name}: redis-py answered with {used.__name__}, not {parser.__name__}")
        backends[name] = backend
    rounds: dict[str, list[float]] = {name: [] for name in PARSERS}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            rounds[name].append(await pairs(backend, args.calls, ids))
    for backend in backends.values():
        await backend.redis.aclose()
    return rounds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not HIREDIS_AVAILABLE:
        raise SystemExit("hiredis is not installed: `.venv/bin/pip install hiredis` (a dependency of the project)")
    import redis

    info = machine_info([], [])
    server = start_redis(Path(tempfile.mkdtemp(prefix="tg-redis-client-")))
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        stats = redis.Redis(port=server.port)
        stats.config_resetstat()
        rounds = asyncio.run(run(args, url))
        scripts = stats.info("commandstats").get("cmdstat_evalsha", {})
        stats.close()
    finally:
        server.stop()
    print("# The Redis client's cost per request (bench/redis_client.py)\n")
    given = sys.argv[1:] if argv is None else argv
    print(f"`{' '.join(['python -m bench.redis_client', *given])}` — {info['date']}")
    print(f"- CPU: {info['cpu']}; redis-py {redis.__version__}; {args.rounds} rounds of {args.calls} pairs\n")
    print("| parser | client CPU µs per reserve + settle, median | rounds |")
    print("|---|---|---|")
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for name, values in rounds.items():
        print(f"| {name} | {medians[name]:.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    slow, fast = medians["python (RESP3)"], medians["hiredis"]
    print(f"\nhiredis: {slow / fast:.2f}x fewer client CPU µs per pair ({slow - fast:.0f} µs less).")
    if args.server and scripts:
        print(f"Redis' own time per script call (INFO commandstats, every call of the run): "
              f"{scripts['usec_per_call']:.0f} µs over {scripts['calls']} calls.")


if __name__ == "__main__":
    main()
