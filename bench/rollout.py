"""Rollouts: what a shadow share costs the serving path, and how soon a breached guard puts traffic back.

    .venv/bin/python -m bench.rollout [--seconds 8] [--rounds 2]

(a) Tier `mid` has two versions, each in front of its own upstream with a fixed cost per request (first token
    50 ms, then 10 ms per token, 16 tokens), so what changes is the gateway's own work. 16 clients send requests
    back to back (non-streamed, the cache off) while the rollout shadows 0%, 50% or 100% of them to `v2`; the
    phases alternate for `--rounds` rounds in one run, and the client-measured latency of each share is compared
    with the 0% one's (side by side, same process, same upstreams).
(b) A canary at 100% on `v2` with guards (error rate above 10% over at least 5 requests in a 5 s window, breached
    for 1 s); 16 clients keep sending; `v2`'s upstream is stopped. Measured from the stop: the first answer from
    `v1` (the candidate passed over), the guard's rollback (`rolled_back` by `guard` in the rollout's status), and
    how many answers were not 200.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from assets.model_source import DEFAULT_MODEL, prepare_model
from bench.fixed_latency_upstream import fixed_latency_app
from gateway.app import create_app
from gateway.settings import Settings
from gateway.tenants.records import ADMIN
from gateway.tenants.store import TenantStore

CONCURRENCY = 16
TIERS = """
tiers:
  mid:
    backend: openai
    model: fixed
    urls: ["{v1}"]
    max_concurrency: 64
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "1"
    context_limit: 4096
    serving: v1
    versions:
      - name: v1
      - name: v2
        urls: ["{v2}"]
"""
PLANS = """
default_plan: standard
plans:
  standard: {allowed_tiers: [mid], default_tier: mid, cache: {enabled: false}}
"""
REQUEST = {"model": "mid", "max_tokens": 16}


class Server:
    def __init__(self, app: object) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def load(url: str, key: str, seconds: float, seen: list[tuple[float, int, str]] | None = None) -> list[float]:
    """CONCURRENCY clients back to back for `seconds`; each answer's latency (and, into `seen`, when it ended,
    its status and version)."""
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=64)) as client:
        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < stop:
                i += 1
                body = REQUEST | {"messages": [{"role": "user", "content": f"question {w}-{i}-{time.time()}"}]}
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                if seen is not None:
                    seen.append((time.monotonic(), r.status_code, r.headers.get("x-tiergate-model-version", "")))

        await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return latencies


def admin(url: str, key: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
        r = c.post(path, json=body) if body is not None else c.get(path)
    r.raise_for_status()
    return r.json()


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def gateway(tmp: Path, v1: str, v2: str) -> tuple[Settings, str, str]:
    models = Path.home() / ".local/share/tiergate/models"
    prepare_model(DEFAULT_MODEL, models, progress=False)  # its tokenizer counts prompt tokens
    (tmp / "tiers.yaml").write_text(TIERS.replace("{v1}", v1).replace("{v2}", v2))
    (tmp / "plans.yaml").write_text(PLANS)
    settings = Settings(data_dir=tmp / "data", models_dir=models, tiers_file=tmp / "tiers.yaml",
                        plans_file=tmp / "plans.yaml", cache_enabled=False)
    store = TenantStore(settings.state_db)
    store.create_tenant("bench", "standard")
    key = store.issue_key("bench")[1]
    admin_key = store.issue_key(None, roles=(ADMIN,))[1]
    store.close()
    return settings, key, admin_key


def shadow_cost(seconds: float, rounds: int) -> list[dict[str, Any]]:
    shares = (0.0, 0.5, 1.0)
    got: dict[float, list[float]] = {s: [] for s in shares}
    with Server(fixed_latency_app(0.05, 0.01)) as v1, Server(fixed_latency_app(0.05, 0.01)) as v2, \
            tempfile.TemporaryDirectory() as name:
        settings, key, admin_key = gateway(Path(name), v1.url, v2.url)
        with Server(create_app(settings)) as gw:
            time.sleep(1.0)  # the remote versions' first health checks
            asyncio.run(load(gw.url, key, 1.0))  # warm-up: tokenizer, connections
            for _ in range(rounds):
                for share in shares:
                    admin(gw.url, admin_key, "/admin/rollouts", {"tier": "mid", "version": "v2", "shadow": share,
                                                                 "reason": "bench"})
                    got[share] += asyncio.run(load(gw.url, key, seconds))
                    time.sleep(0.5)  # shadow calls still in flight end before the next phase
                    admin(gw.url, admin_key, "/admin/rollouts/mid/rollback", {"reason": "bench"})
            metrics = httpx.get(f"{gw.url}/metrics", headers={"authorization": f"Bearer {admin_key}"}).text
    shadowed = {line.split("result=")[1].split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("tiergate_rollout_shadow_requests_total{")}
    base = got[0.0]
    return [{"shadow": f"{share:.0%}", "requests": len(v), "p50_ms": 1000 * pct(v, 50), "p95_ms": 1000 * pct(v, 95),
             "p50_ratio": pct(v, 50) / pct(base, 50), "p95_ratio": pct(v, 95) / pct(base, 95)}
            for share, v in got.items()] + [{"shadowed": shadowed}]


def guard_rollback() -> dict[str, Any]:
    with Server(fixed_latency_app(0.05, 0.01)) as v1, tempfile.TemporaryDirectory() as name:
        candidate = Server(fixed_latency_app(0.05, 0.01)).__enter__()
        settings, key, admin_key = gateway(Path(name), v1.url, candidate.url)
        with Server(create_app(settings)) as gw:
            time.sleep(1.0)
            admin(gw.url, admin_key, "/admin/rollouts", {
                "tier": "mid", "version": "v2", "share": 1.0, "reason": "bench",
                "guards": {"max_error_rate": 0.1, "max_ttft_p95_ratio": None, "max_tpot_p95_ratio": None,
                           "min_requests": 5, "window_s": 5.0, "breach_for_s": 1.0}})
            seen: list[tuple[float, int, str]] = []
            rolled: list[float] = []

            def kill_and_watch() -> None:
                time.sleep(2.0)
                rolled.append(time.monotonic())
                candidate.__exit__()
                while admin(gw.url, admin_key, "/admin/rollouts")["data"][0]["stage"] != "rolled_back":
                    time.sleep(0.02)
                rolled.append(time.monotonic())

            watcher = threading.Thread(target=kill_and_watch)
            watcher.start()
            asyncio.run(load(gw.url, key, 10.0, seen))
            watcher.join()
            event = admin(gw.url, admin_key, "/admin/rollouts/history?tier=mid")["data"][0]
    killed, back = rolled
    after = [s for s in seen if s[0] >= killed]
    first_v1 = min(t for t, status, v in after if v == "v1")
    last_v2 = max((t for t, status, v in after if v == "v2"), default=killed)
    return {"first_v1_after_kill_ms": 1000 * (first_v1 - killed), "last_v2_after_kill_ms": 1000 * (last_v2 - killed),
            "guard_rollback_after_kill_ms": 1000 * (back - killed), "answers_after_kill": len(after),
            "not_200": sum(status != 200 for _, status, _ in after), "who": event["who"], "reason": event["reason"]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each shadow phase")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three shadow shares, alternating")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("tiergate").setLevel(logging.ERROR)
    print(f"CPU: {cpu_model()}\n")
    rows = shadow_cost(args.seconds, args.rounds)
    print(f"(a) shadow share vs the serving path's latency, c={CONCURRENCY}, upstream 50 ms + 15 x 10 ms")
    print("| shadow | requests | p50 (ms) | p95 (ms) | p50 / 0% | p95 / 0% |")
    print("|---|---|---|---|---|---|")
    for r in rows[:-1]:
        print(f"| {r['shadow']} | {r['requests']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['p50_ratio']:.3f} | "
              f"{r['p95_ratio']:.3f} |")
    print(f"\nshadow calls to v2 by result: {rows[-1]['shadowed']}\n")
    g = guard_rollback()
    print(f"(b) candidate killed under c={CONCURRENCY}, guard: error rate > 10% over >= 5 requests, 5 s window, "
          "breached for 1 s")
    print("| first v1 answer | last v2 answer | rolled back by guard | answers after the kill | not 200 |")
    print("|---|---|---|---|---|")
    print(f"| {g['first_v1_after_kill_ms']:.0f} ms | {g['last_v2_after_kill_ms']:.0f} ms | "
          f"{g['guard_rollback_after_kill_ms']:.0f} ms | {g['answers_after_kill']} | {g['not_200']} |")
    print(f"\naudit: by {g['who']}: {g['reason']}")


if __name__ == "__main__":
    main()
