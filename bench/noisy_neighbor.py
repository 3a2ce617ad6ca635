"""Noisy neighbour: tenant A floods a tier at 10x its share while tenant B sends a steady stream.

    .venv/bin/python -m bench.noisy_neighbor [--seconds 15]

For each dispatch policy (vtc: Tiergate's fair dispatch; fifo: no fairness, the baseline), B's time to
first token (TTFT, measured by the client) is taken alone, then under A's flood, in the same run. The tier
has 8 dispatch slots in front of an upstream with a fixed cost per request (first token 50 ms, then
20 ms per token, 16 tokens), so what changes B's TTFT is the gateway's queueing alone.
Target (issue 4): B's p95 TTFT under the flood within 1.5x of B alone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from assets.model_source import DEFAULT_MODEL, prepare_model
from bench.fixed_latency_upstream import fixed_latency_app
from gateway.app import create_app
from gateway.settings import Settings
from gateway.tenants.store import TenantStore

SLOTS = 8
TIERS = """
tiers:
  mid:
    backend: openai
    model: fixed
    urls: ["{url}"]
    max_concurrency: {slots}
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "1"
    context_limit: 4096
"""
PLANS = """
default_plan: standard
plans:
  standard: {allowed_tiers: [mid], default_tier: mid}
"""
BODY = {"model": "auto", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "stream": True}


class Server:
    def __init__(self, app: object, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def ttft(client: httpx.AsyncClient, url: str, key: str) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=BODY,
                             headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        first = None
        async for line in r.aiter_lines():
            if first is None and '"content"' in line:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def phase(url: str, keys: dict[str, str], seconds: float, flood: bool) -> tuple[list[float], int]:
    stop = time.monotonic() + seconds
    served_a = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        async def flooder() -> None:
            nonlocal served_a
            while time.monotonic() < stop:
                await ttft(client, url, keys["a"])
                served_a += 1

        async def steady() -> list[float]:
            out = []
            while time.monotonic() < stop:
                t = time.monotonic()
                out.append(await ttft(client, url, keys["b"]))
                await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - t)))
            return out

        # A's share is half the tier (two tenants); 10x that share is 5x the slots, always outstanding
        floods = [asyncio.ensure_future(flooder()) for _ in range(5 * SLOTS)] if flood else []
        await asyncio.sleep(0.5 if flood else 0)
        b = await steady()
        for f in floods:
            await f
    return b, served_a


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def run(seconds: float) -> list[dict[str, object]]:
    models = Path.home() / ".local/share/tiergate/models"
    prepare_model(DEFAULT_MODEL, models, progress=False)  # its tokenizer counts prompt tokens
    results = []
    with Server(fixed_latency_app(0.05, 0.02), 18601) as upstream:
        for policy in ("vtc", "fifo"):
            with tempfile.TemporaryDirectory() as name:
                tmp = Path(name)
                (tmp / "tiers.yaml").write_text(TIERS.replace("{url}", upstream.url).replace("{slots}", str(SLOTS)))
                (tmp / "plans.yaml").write_text(PLANS)
                settings = Settings(data_dir=tmp / "data", models_dir=models, tiers_file=tmp / "tiers.yaml",
                                    plans_file=tmp / "plans.yaml", dispatch_policy=policy)
                store = TenantStore(settings.state_db)
                keys = {}
                for t in ("a", "b"):
                    store.create_tenant(t, "standard")
                    keys[t] = store.issue_key(t)[1]
                store.close()
                with Server(create_app(settings), 18602) as gw:
                    time.sleep(1.0)  # the remote tier's first health check
                    asyncio.run(phase(gw.url, keys, 1.0, flood=False))  # warm-up: tokenizer, connections
                    alone, _ = asyncio.run(phase(gw.url, keys, seconds, flood=False))
                    noisy, served_a = asyncio.run(phase(gw.url, keys, seconds, flood=True))
                results.append({"policy": policy, "b_alone_p50_ms": 1000 * p(alone, 50),
                                "b_alone_p95_ms": 1000 * p(alone, 95), "b_flood_p50_ms": 1000 * p(noisy, 50),
                                "b_flood_p95_ms": 1000 * p(noisy, 95), "ratio_p95": p(noisy, 95) / p(alone, 95),
                                "b_requests": len(noisy), "a_requests": served_a})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = run(args.seconds)
    print("| policy | B alone p50 / p95 (ms) | B under flood p50 / p95 (ms) | p95 ratio | B requests | A requests |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['b_alone_p50_ms']:.0f} / {r['b_alone_p95_ms']:.0f} | "
              f"{r['b_flood_p50_ms']:.0f} / {r['b_flood_p95_ms']:.0f} | {r['ratio_p95']:.2f} | "
              f"{r['b_requests']} | {r['a_requests']} |")


if __name__ == "__main__":
    main()
