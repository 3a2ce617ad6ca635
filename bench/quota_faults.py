"""Quota faults: gateway replicas' quota state on one Redis, under load, through a killed replica, a frozen
Redis and a restarted one; at the end, is every picodollar where the ledger says it is?

    .venv/bin/python -m bench.quota_faults [--replicas 4] [--workers 4] [--rounds 5] [--rows 400]

Each replica is a process running what a gateway runs for quotas (QuotaService over FailoverBackend over
RedisBackend, failing open, the reaper billing from the ledger) and the real ledger, one SQLite file for all,
as gateway processes on one host share it. Its workers loop over two tenants, `tight` (a budget of 40
requests' upper bounds, spent within the first moments) and `roomy` (never short): reserve the upper bound,
"run" a few ms, make the ledger row durable, settle to the real use (1 to 100% of the bound), as the gateway
does. Each round waits for `--rows` new ledger rows between faults (counts, not timings): SIGKILL a replica
mid-load (a fresh one takes its place), SIGSTOP Redis for 2 s then SIGCONT, restart Redis (AOF, so its data
survives). Then the replicas stop, the leases run out and a last reaper round runs. Found, per tenant:
drift (Redis' spend minus the ledger's, in picodollars: must be 0), overshoot (the ledger's spend past the
budget: at most one upper bound), and over both, concurrency slots and reservations still held (must be 0).
tests/quotas/test_chaos.py runs one short round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UB_TOKENS = 100  # each request reserves 100 tokens ...
PRICE_PER_TOKEN = Decimal("1e-7")  # ... at $1e-7 each: an upper bound of $0.00001 = 1e7 picodollars
UB_PICO = 10_000_000
BUDGETS_USD = {"tight": Decimal("0.0004"), "roomy": Decimal("1000")}  # tight: 40 upper bounds
MAX_CONCURRENT = {"tight": 3, "roomy": 6}


@dataclass
class Scenario:
    replicas: int = 3
    workers: int = 3  # concurrent requests per replica
    rounds: int = 1
    rows_per_phase: int = 100  # new ledger rows to wait for before each fault and at the end
    freeze_s: float = 2.0  # Redis SIGSTOPped this long
    lease_s: float = 2.0  # a reservation's lease (the gateway's is 900 s); the reaper returns it after
    reap_every_s: float = 0.25
    phase_timeout_s: float = 90.0


@dataclass
class TenantResult:
    budget_pico: int
    ledger_pico: int  # the sum of its rows' prices
    redis_pico: int  # its month counter in Redis
    rows: int

    @property
    def drift_pico(self) -> int:
        return self.redis_pico - self.ledger_pico

    @property
    def overshoot_pico(self) -> int:
        return max(0, self.ledger_pico - self.budget_pico)


@dataclass
class Report:
    seconds: float
    faults: list[str]
    totals: dict[str, int]  # summed over replicas: admitted, refused, unavailable, local, journal, ...
    tenants: dict[str, TenantResult]
    reaped_at_end: int
    slots_held: int
    reservations_held: int

    def ok(self) -> bool:
        return (all(t.drift_pico == 0 and t.overshoot_pico <= UB_PICO for t in self.tenants.values())
                and self.slots_held == 0 and self.reservations_held == 0)

    def table(self) -> str:
        t = self.totals
        requests = t["admitted"] + t["refused"] + t["unavailable"]
        lines = ["| requests | admitted | refused (429) | unavailable (503) | admitted locally in outages | "
                 "outage journal: batches / by id | settles retried | reaped | faults | drift (pico) | "
                 "overshoot (upper bounds) | slots / reservations held |", "|" + "---|" * 12]
        drift = ", ".join(f"{n} {r.drift_pico}" for n, r in self.tenants.items())
        over = ", ".join(f"{n} {r.overshoot_pico / UB_PICO:.2f}" for n, r in self.tenants.items())
        lines.append(f"| {requests} | {t['admitted']} | {t['refused']} | {t['unavailable']} | {t['local']} | "
                     f"{t['journal']} / {t['journal_requests']} | {t['settle_retries']} | "
                     f"{t['reaped'] + self.reaped_at_end} | {len(self.faults)} | {drift} | {over} | "
                     f"{self.slots_held} / {self.reservations_held} |")
        return "\n".join(lines)


# ---- one replica (a child process) ----

async def replica(redis_url: str, ledger_path: Path, name: str, workers: int, lease_s: float,
                  reap_every_s: float, out: Path) -> None:
    from quotas.backends.base import QuotaBackendError
    from quotas.backends.failover import FailoverBackend
    from quotas.backends.redis import RedisBackend
    from quotas.ledger import Ledger, LedgerUnavailable
    from quotas.ledger_rows import LedgerRow
    from quotas.plans import Limits, Plan
    from quotas.reaper import run_reaper
    from quotas.reservations import QuotaService
    from quotas.seed import ledger_billing, ledger_spend_source

    plans = {t: Plan(allowed_tiers=["mid"], default_tier="mid",
                     limits=Limits(budget_day_usd=BUDGETS_USD[t], max_concurrent=MAX_CONCURRENT[t]))
             for t in BUDGETS_USD}
    ledger = Ledger(ledger_path, record_timeout_s=30.0)
    ledger.start()
    redis = RedisBackend(redis_url, replica_ttl_s=max(2.0, 4 * reap_every_s), reap_claim_s=1.0)
    backend = FailoverBackend(redis, mode="open", ledger_spend=ledger_spend_source(ledger))
    quotas = QuotaService(backend, lease_s=lease_s)
    reaper = asyncio.create_task(run_reaper(backend, every_s=reap_every_s, billed=ledger_billing(ledger),
                                            renew=quotas.renew_leases))  # as the gateway's (gateway/app.py)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    stats: Counter[str] = Counter()

    async def work(w: int) -> None:
        rng = random.Random(f"{name}-{w}")
        n = 0
        while not stop.is_set():
            n += 1
            tenant = ("tight", "roomy")[(n + w) % 2]
            rid = f"{name}-{w}-{n}"
            try:
                _, res = await quotas.reserve(request_id=rid, tenant=tenant, plan=plans[tenant], key_id="k",
                                              key_limits=None, tokens=UB_TOKENS, price=PRICE_PER_TOKEN * UB_TOKENS)
            except QuotaBackendError:  # the gateway's retryable 503
                stats["unavailable"] += 1
                await asyncio.sleep(0.02)
                continue
            if res is None:
                stats["refused"] += 1
                await asyncio.sleep(0.005)
                continue
            stats["admitted"] += 1
            await asyncio.sleep(rng.uniform(0.002, 0.02))  # the model runs
            used = rng.randint(1, UB_TOKENS)
            price = PRICE_PER_TOKEN * used
            row = LedgerRow(request_id=rid, ts=time.time(), tenant=tenant, key_id="k", tier="mid", model="m",
                            status="ok", http_status=200, input_tokens=used, output_tokens=0, price_usd=price,
                            compute_cost_usd=Decimal(0), cost_basis="none", ttft_s=None, total_s=0.01)
            try:  # durable first: a replica killed before the settle is then billed this by the reaper
                await ledger.record(row)
            except LedgerUnavailable:  # still queued: the writer keeps it and retries
                stats["ledger_slow"] += 1
            await quotas.settle(res, tokens=used, price=price)

    (out.parent / f"{name}.ready").touch()
    await asyncio.gather(*(work(w) for w in range(workers)))
    reaper.cancel()
    await backend.close()  # applies what is left of the outage journal, waits for settles still retrying
    ledger.close()
    stats.update(local=backend.num_local_reservations, journal=backend.num_journal_batches,
                 journal_requests=backend.num_journal_requests, settle_retries=redis.num_settle_retries,
                 reaped=redis.num_reaped)
    out.write_text(json.dumps(stats))


# ---- the conductor ----

class AofRedis:
    """A redis-server on a free loopback port whose data survives a restart (AOF, fsync at every write)."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AofRedis:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):  # not -LOADING: the AOF is read
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()  # a clean shutdown: the AOF is complete
            self.proc.wait(timeout=30)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def run_scenario(workdir: Path, sc: Scenario, log: bool = False) -> Report:
    from quotas.ledger import Ledger

    t0 = time.monotonic()
    redis = AofRedis(workdir / "redis").start()
    ledger_path = workdir / "ledger.sqlite3"
    Ledger(ledger_path).close()  # the schema, before several processes race to create it
    procs: dict[str, subprocess.Popen[bytes]] = {}
    names = iter(f"r{i}" for i in range(10_000))
    faults: list[str] = []

    def say(what: str) -> None:
        if log:
            print(f"{time.monotonic() - t0:6.1f}s  {what}", flush=True)

    def spawn() -> None:
        name = next(names)
        logf = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (the child's, for its life)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "bench.quota_faults", "replica", redis.url, str(ledger_path), name,
             str(sc.workers), str(sc.lease_s), str(sc.reap_every_s), str(workdir / f"{name}.json")],
            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + sc.phase_timeout_s
        while not (workdir / f"{name}.ready").exists():
            assert procs[name].poll() is None, f"replica {name} died: {(workdir / f'{name}.log').read_text()}"
            assert time.monotonic() < deadline, f"replica {name} did not start"
            time.sleep(0.05)

    def rows() -> int:
        with closing(sqlite3.connect(ledger_path, timeout=30)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0])

    def wait_rows(n: int) -> None:
        target, deadline = rows() + n, time.monotonic() + sc.phase_timeout_s
        while (have := rows()) < target:
            assert time.monotonic() < deadline, f"load stalled at {have} of {target} ledger rows"
            time.sleep(0.05)

    try:
        for _ in range(sc.replicas):
            spawn()
        say(f"{sc.replicas} replicas under load")
        for _ in range(sc.rounds):
            wait_rows(sc.rows_per_phase)
            victim = next(n for n, p in procs.items() if p.poll() is None)
            held = _kill_holding(redis.url, victim, procs[victim], sc.phase_timeout_s)
            faults.append(f"SIGKILL {victim} holding {held} reservations")
            say(faults[-1])
            spawn()
            wait_rows(sc.rows_per_phase)
            redis.signal(signal.SIGSTOP)
            time.sleep(sc.freeze_s)
            redis.signal(signal.SIGCONT)
            faults.append(f"SIGSTOP redis {sc.freeze_s:g}s")
            say(faults[-1])
            wait_rows(sc.rows_per_phase)
            redis.restart()
            faults.append("restart redis")
            say(faults[-1])
            wait_rows(sc.rows_per_phase)
        totals: Counter[str] = Counter()
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.terminate()
                assert proc.wait(timeout=sc.phase_timeout_s) == 0, (workdir / f"{name}.log").read_text()
                totals.update(json.loads((workdir / f"{name}.json").read_text()))
        say("replicas stopped; the leases run out")
        time.sleep(sc.lease_s + 1.5)  # and any reaper's claim (1 s) with them
        report = asyncio.run(_account(redis.url, ledger_path, time.monotonic() - t0, faults, totals))
        say(f"accounted: {'ok' if report.ok() else 'DRIFT'}")
        return report
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        redis.stop()


def _kill_holding(redis_url: str, name: str, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGKILL a replica the moment Redis shows it holding two reservations or more (one at least, if it
    never holds two), so the kill interrupts runs between reserve and settle; how many it held. The replica is
    frozen (SIGSTOP) and counted again before the kill: read while it ran, a count could be settled in the moment
    before the kill, and the runs said interrupted were not (none left for a reaper to bring back)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    deadline = time.monotonic() + timeout_s

    def holding() -> int:
        return sum(rid.startswith(f"{name}-".encode()) for tenant in BUDGETS_USD
                   for rid in client.zrange(f"{{tg:{tenant}}}:leases", 0, -1))

    try:
        while True:
            held = holding()
            if held >= 2 or (held and time.monotonic() > deadline - timeout_s / 2):
                proc.send_signal(signal.SIGSTOP)
                time.sleep(0.05)  # a settle it sent before it stopped reaches Redis
                if (held := holding()) > 0:
                    proc.kill()
                    proc.wait()
                    return held
                proc.send_signal(signal.SIGCONT)  # it settled them all: wait for others
            assert time.monotonic() < deadline, f"replica {name} never held a reservation"
            time.sleep(0.001)
    finally:
        client.close()


async def _account(redis_url: str, ledger_path: Path, seconds: float, faults: list[str],
                   totals: Counter[str]) -> Report:
    """A last reaper round, then what Redis holds against what the ledger billed."""
    from quotas.backends.redis import RedisBackend
    from quotas.ledger import Ledger
    from quotas.money import to_pico
    from quotas.seed import ledger_billing

    ledger = Ledger(ledger_path)
    redis = RedisBackend(redis_url, timeout_s=5.0, reap_claim_s=1.0)
    try:
        reaped = 0
        for _ in range(20):
            reaped += await redis.reap(ledger_billing(ledger))
            if not any([await redis.redis.zcard(redis.leases_key(t)) for t in BUDGETS_USD]):
                break
            await asyncio.sleep(0.5)
        tenants, slots, held = {}, 0, 0
        for tenant, budget in BUDGETS_USD.items():
            rows = ledger.rows(tenant=tenant)
            spent = await redis.spent(tenant, ["t"], time.time())
            assert spent is not None
            tenants[tenant] = TenantResult(to_pico(budget), sum(to_pico(r.price_usd) for r in rows),
                                           spent["t"][1], len(rows))
            slots += await redis.redis.zcard(f"{redis.base(tenant, 't')}:inflight")
            keys = [key async for key in redis.redis.scan_iter(match=f"{redis.tag(tenant)}:res:*", count=1000)]
            pipe = redis.redis.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "st")
            held += sum(state == b"r" for state in await pipe.execute())
        return Report(round(seconds, 1), faults, dict(totals), tenants, reaped, slots, held)
    finally:
        await redis.close()
        ledger.close()


def main() -> None:
    if sys.argv[1:2] == ["replica"]:
        url, ledger, name, workers, lease, reap, out = sys.argv[2:9]
        asyncio.run(replica(url, Path(ledger), name, int(workers), float(lease), float(reap), Path(out)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=400, help="new ledger rows between faults")
    args = ap.parse_args()
    sc = Scenario(replicas=args.replicas, workers=args.workers, rounds=args.rounds, rows_per_phase=args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        report = run_scenario(Path(tmp), sc, log=True)
    print(json.dumps({**asdict(report), "ok": report.ok()}, indent=1, default=str))
    print(report.table())
    print("every picodollar accounted for" if report.ok() else "DRIFT FOUND")


if __name__ == "__main__":
    main()
