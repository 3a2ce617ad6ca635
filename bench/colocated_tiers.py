"""Co-located tiers with and without the core budget, side by side, through `tiergate serve` (real SmolLM2 engines).

    .venv/bin/python -m bench.colocated_tiers [--rounds 2] [--streams 16] [--output-len 128] [--overload 64]
                                              [--overload-len 32] [--out results.json]

Two modes: `budget` (the default: each local engine pinned to its own share of the cores, torch and OpenMP
threads to match) and `off` (TIERGATE_CORE_BUDGET=off: both engines unpinned, each sizing its thread pool for
every core). Each round starts `tiergate serve` once per mode, budget then off, so a machine shared with other
work drifts on both alike; every run is reported. The tiers file is the shipped one without `small` (full and
mid only); the plan allows both, waits at most 10 s and sheds to a cheaper tier.

In each run, after one warm-up request per tier:
- alone: --streams streams to `full` only, with `mid` idle (what a split costs a tier whose neighbour has
  nothing to do: pinned, it keeps its own share only).
- mixed: --streams streams to `full` and as many to `mid` at once, each a ShareGPT first turn (cut to 600
  characters) asking for --output-len tokens (sampled, so the answer cache is bypassed). Reported: aggregate
  tokens/s (all completion tokens over the whole phase) and each tier's (its tokens over its own span).
- overload: --overload requests of --overload-len tokens to `full` at once, more than its slots and its 10 s
  wait hold. Reported: how many `full` answered, how many were shed to `mid` (x-tiergate-tier), how many were
  refused (503), and any stream cut short (an engine restarted: its restarts are in the engines column).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench.serve_gateway import free_port, tiergate_serve

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = Path.home() / ".local/share/tiergate/models"
PLANS = """
default_plan: bench
plans:
  bench:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: full
    max_queue_wait_s: 10
    shed_to_cheaper: true
"""
MODES = {"budget": {}, "off": {"TIERGATE_CORE_BUDGET": "off"}}


@dataclass
class Served:
    url: str
    key: str
    admin_key: str
    log: list[str]


@contextmanager
def served(mode: str, models_dir: Path, *, plans: str = PLANS, ladder: str | None = None) -> Iterator[Served]:
    """`tiergate serve` on a free port with full and mid, `plans` (the plan above by default), the answer cache off,
    and `ladder` as the degradation ladder's file when given (the shipped one otherwise)."""
    with tempfile.TemporaryDirectory(prefix="tiergate-colocated-") as tmp:
        data = Path(tmp)
        tiers = yaml.safe_load((ROOT / "tiers" / "tiers.yaml").read_text())
        tiers["tiers"].pop("small")
        (data / "tiers.yaml").write_text(yaml.safe_dump(tiers))
        (data / "plans.yaml").write_text(plans)
        if ladder is not None:
            (data / "ladder.yaml").write_text(ladder)
        port = free_port()
        env = os.environ | MODES[mode] | {
            "TIERGATE_MODELS_DIR": str(models_dir), "TIERGATE_DATA_DIR": str(data / "data"),
            "TIERGATE_PORT": str(port), "TIERGATE_TIERS_FILE": str(data / "tiers.yaml"),
            "TIERGATE_PLANS_FILE": str(data / "plans.yaml"), "TIERGATE_BUILD_MISSING_MODELS": "0",
            "TIERGATE_CACHE_ENABLED": "0"} | ({"TIERGATE_LADDER_FILE": str(data / "ladder.yaml")} if ladder else {})
        with tiergate_serve(env, ready_timeout_s=600) as started:
            yield Served(f"http://127.0.0.1:{port}", started.demo_key, started.admin_key, started.output)


@dataclass
class Answer:
    tier: str  # who answered (x-tiergate-tier), or the status code when refused
    tokens: int
    end: float  # seconds since the phase started


async def stream(c: httpx.AsyncClient, t0: float, model: str, prompt: str, max_tokens: int) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Answer(str(r.status_code), 0, time.perf_counter() - t0)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
            return Answer(r.headers["x-tiergate-tier"], tokens, time.perf_counter() - t0)
    except httpx.HTTPError as exc:  # a stream cut short (an engine restarted under load): counted, not fatal
        return Answer(f"error: {type(exc).__name__}", 0, time.perf_counter() - t0)


async def phase(s: Served, requests: list[tuple[str, str]], max_tokens: int) -> tuple[float, list[Answer]]:
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=s.url, headers={"authorization": f"Bearer {s.key}"}, timeout=600,
                                 limits=limits) as c:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(stream(c, t0, model, prompt, max_tokens) for model, prompt in requests))
        return time.perf_counter() - t0, list(answers)


def tier_details(s: Served) -> dict[str, dict[str, object]]:
    """Each tier's engine placement and restarts, from /health's admin details."""
    with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {s.admin_key}"}, timeout=30) as c:
        tiers = c.get("/health").json()["tiers"]
    return {name: {"group": t.get("hardware_group"), "cores": t["replicas"][0].get("cores"),
                   "threads": t["replicas"][0].get("threads"), "restarts": sum(r["restarts"] for r in t["replicas"])}
            for name, t in tiers.items()}


def one_run(mode: str, prompts: list[str], args: argparse.Namespace) -> dict[str, object]:
    with served(mode, args.models_dir) as s:
        asyncio.run(phase(s, [("full", prompts[0]), ("mid", prompts[0])], 16))  # warm-up
        n = args.streams
        wall, alone = asyncio.run(phase(s, [("full", p) for p in prompts[:n]], args.output_len))
        solo = {"full_alone_tok_s": sum(a.tokens for a in alone) / wall}
        wall, answers = asyncio.run(phase(s, [("full", p) for p in prompts[:n]] + [("mid", p) for p in prompts[:n]],
                                          args.output_len))
        mixed: dict[str, object] = {"aggregate_tok_s": sum(a.tokens for a in answers) / wall, "wall_s": wall}
        for tier in ("full", "mid"):
            mine = answers[:n] if tier == "full" else answers[n:]
            mixed[f"{tier}_tok_s"] = sum(a.tokens for a in mine) / max(a.end for a in mine)
            mixed[f"{tier}_answered_by"] = dict(Counter(a.tier for a in mine))
        _, burst = asyncio.run(phase(s, [("full", prompts[i % len(prompts)]) for i in range(args.overload)],
                                     args.overload_len))
        overload = dict(Counter(a.tier for a in burst))
        engines = tier_details(s)
    return {"mode": mode, "engines": engines, "solo": solo, "mixed": mixed, "overload": overload}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="budget/off pairs, interleaved")
    parser.add_argument("--streams", type=int, default=16, help="streams per tier in the mixed phase")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--overload", type=int, default=64, help="requests to full at once in the overload phase")
    parser.add_argument("--overload-len", type=int, default=32, help="tokens each overload request asks for")
    parser.add_argument("--models-dir", type=Path, default=Path(os.environ.get("TIERGATE_MODELS_DIR", MODELS_DIR)))
    parser.add_argument("--out", type=Path, default=None, help="also write every run as JSON here")
    args = parser.parse_args()

    from assets.datasets import sharegpt_first_turns

    prompts = [t[:600] for t in sharegpt_first_turns(limit=4 * max(args.streams, 16)) if len(t) >= 40]
    print(f"# {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs; "
          f"{args.streams}+{args.streams} streams of {args.output_len} tokens; overload {args.overload} to full")
    runs = []
    for i in range(args.rounds):
        for mode in MODES:
            run = one_run(mode, prompts, args)
            runs.append(run)
            m = run["mixed"]
            print(f"round {i + 1} {mode:6s} full alone {run['solo']['full_alone_tok_s']:6.1f} tok/s | mixed: "
                  f"aggregate {m['aggregate_tok_s']:.1f} tok/s, full {m['full_tok_s']:6.1f}, mid {m['mid_tok_s']:6.1f} "
                  f"(answered by {m['full_answered_by']} {m['mid_answered_by']}) | overload to full: "
                  f"{run['overload']} | engines: {run['engines']}", flush=True)
    for mode in MODES:
        rates = [r["mixed"]["aggregate_tok_s"] for r in runs if r["mode"] == mode]
        print(f"{mode:6s} aggregate tok/s per run: {', '.join(f'{x:.1f}' for x in rates)}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
