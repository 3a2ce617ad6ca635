"""The engine served: the same streams straight to an engine's port and through `tiergate serve`, side by side.

    .venv/bin/python -m bench.engine_served [--streams 16,64] [--output-len 128] [--rounds 2] [--out runs.json]

One `tiergate serve` with the shipped tiers file less `small` (real SmolLM2 engines for `full` and `mid`, each on
its share of the cores as the host core budget plans them), the answer cache off, a plan that neither waits nor
sheds and a degradation ladder of level 0 only (every request reaches the tier it names, so both sides do the same
work; the shipped ladder sheds standard traffic once 64 streams queue for long). For each stream count, in
each round, in this order so that drift on a shared machine falls on both sides alike:

- direct: the streams straight to the `full` engine's own port (found from the engine process's command line);
- gateway: the same streams to `full` through the gateway (auth, quotas, ledger, relaying every chunk);
- mid through the gateway, alone;
- mixed: half the streams to `full` and half to `mid` through the gateway at once.

Every stream is a ShareGPT first turn (cut to 600 characters) asking for --output-len tokens, sampled at
temperature 0.8. Reported: completion tokens per second over the phase (all streams' tokens over the wall time
from the first request to the last token), the gateway's share of the direct rate, and mixed against the faster
single tier's rate through the gateway (issue 18's two targets: >= 90% each). In the mixed phase the slower tier's
streams end last, so its wall time also gives the sum of each tier's own rate (its tokens over the time to its
last stream's end): what the two tiers deliver while both are busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench import colocated_tiers

MODELS_DIR = Path.home() / ".local/share/tiergate/models"
PLANS = """
default_plan: bench
plans:
  bench:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: full
"""
LADDER = "levels:\n  - level: 0\n    name: normal\n"  # no degradation level: the queue is what is measured


@dataclass
class Target:
    gateway: str
    key: str
    engines: dict[str, str]  # tier -> its engine's base URL


def engine_urls() -> dict[str, str]:
    """The engines this process's `tiergate serve` started: tier -> http://127.0.0.1:port (their command lines)."""
    urls = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "engine" in cmd and "serve" in cmd and "--served-name" in cmd and "--port" in cmd:
            urls[cmd[cmd.index("--served-name") + 1]] = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    return urls


@contextmanager
def served(models_dir: Path) -> Iterator[Target]:
    with colocated_tiers.served("budget", models_dir, plans=PLANS, ladder=LADDER) as s:
        engines = engine_urls()
        if set(engines) != {"full", "mid"}:
            raise RuntimeError(f"expected the engines of full and mid, found {engines}")
        yield Target(s.url, s.key, engines)


async def one_stream(c: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                     t0: float) -> tuple[int, float, str]:
    """(completion tokens of one streamed answer (its usage chunk), seconds from t0 to its end, why it failed: ""
    when it did not)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    try:
        async with c.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                why = (await r.aread()).decode(errors="replace")[:200]
                return 0, time.perf_counter() - t0, f"{r.status_code} {why}"
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
    except httpx.HTTPError as exc:
        return 0, time.perf_counter() - t0, repr(exc)
    return tokens, time.perf_counter() - t0, ""


async def phase(requests: list[tuple[str, str, str]], key: str, max_tokens: int) -> dict[str, object]:
    """(url, model, prompt) streams at once: completion tokens per second over the phase, each model's over its own
    span (its tokens over the time to its last stream's end), and the failures (each distinct reason once)."""
    limits = httpx.Limits(max_connections=len(requests) + 4)
    headers = {"authorization": f"Bearer {key}"} if key else {}  # the engine's port takes no key
    async with httpx.AsyncClient(headers=headers, timeout=900, limits=limits) as c:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_stream(c, url, model, prompt, max_tokens, t0)
                                      for url, model, prompt in requests))
        wall = time.perf_counter() - t0
    per_model: dict[str, float] = {}
    for model in {m for _, m, _ in requests}:
        mine = [d for d, (_, m, _) in zip(done, requests, strict=True) if m == model]
        per_model[model] = sum(t for t, _, _ in mine) / max(end for _, end, _ in mine)
    failures = [why for _, _, why in done if why]
    return {"tok_s": sum(t for t, _, _ in done) / wall, "wall_s": wall, "per_model_tok_s": per_model,
            "failed": len(failures), "reasons": sorted(set(failures))}


def one_round(t: Target, prompts: list[str], n: int, output_len: int) -> dict[str, dict[str, float]]:
    chat = "/v1/chat/completions"
    ps = [prompts[i % len(prompts)] for i in range(n)]
    run = {
        "direct_full": phase([(t.engines["full"] + chat, "full", p) for p in ps], "", output_len),
        "gateway_full": phase([(t.gateway + chat, "full", p) for p in ps], t.key, output_len),
        "gateway_mid": phase([(t.gateway + chat, "mid", p) for p in ps], t.key, output_len),
        "gateway_mixed": phase([(t.gateway + chat, "full" if i % 2 == 0 else "mid", p) for i, p in enumerate(ps)],
                               t.key, output_len),
    }
    return {name: asyncio.run(coro) for name, coro in run.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="16,64", help="comma list of concurrent stream counts")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models-dir", type=Path, default=Path(os.environ.get("TIERGATE_MODELS_DIR", MODELS_DIR)))
    parser.add_argument("--out", type=Path, default=None, help="also write every round as JSON here")
    args = parser.parse_args()
    counts = [int(x) for x in args.streams.split(",")]

    from assets.datasets import sharegpt_first_turns

    prompts = [t[:600] for t in sharegpt_first_turns(limit=4 * max(counts)) if len(t) >= 40]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"# bench.engine_served: {cpu}, {len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.2f}; "
          f"streams {counts} of {args.output_len} tokens; {args.rounds} rounds", flush=True)
    runs = []
    with served(args.models_dir) as t:
        asyncio.run(phase([(t.gateway + "/v1/chat/completions", m, prompts[0]) for m in ("full", "mid")], t.key, 8))
        for r in range(args.rounds):
            for n in counts:
                res = one_round(t, prompts, n, args.output_len)
                runs.append({"round": r + 1, "streams": n, **res})
                best_single = max(res["gateway_full"]["tok_s"], res["gateway_mid"]["tok_s"])
                spans = sum(res["gateway_mixed"]["per_model_tok_s"].values())
                reasons = [r for v in res.values() for r in v["reasons"]]
                print(f"round {r + 1} streams {n:3d} | direct full {res['direct_full']['tok_s']:6.1f} tok/s | "
                      f"gateway full {res['gateway_full']['tok_s']:6.1f} "
                      f"({res['gateway_full']['tok_s'] / res['direct_full']['tok_s']:.2f}x direct) | "
                      f"gateway mid {res['gateway_mid']['tok_s']:6.1f} | mixed {res['gateway_mixed']['tok_s']:6.1f} "
                      f"({res['gateway_mixed']['tok_s'] / best_single:.2f}x the faster tier alone; per-tier "
                      f"spans summed {spans:.1f}, {spans / best_single:.2f}x) | failed "
                      f"{sum(int(v['failed']) for v in res.values())} {reasons}",
                      flush=True)
    print(f"# load at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
