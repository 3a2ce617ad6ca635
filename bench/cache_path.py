"""Deterministic cache misses per second through the gateway's cache stage, with the real MiniLM embedder.

    .venv/bin/python -m bench.cache_path [--concurrency 1,16,64] [--rounds 3] [--runtimes torch,onnx] [--cpu 0]

Each request is a new temperature-0 question (ShareGPT first turns of at most 300 characters, all distinct),
sent through `CacheStage.lookup` (exact layer, embedding, faiss search, guards), then, as the pipeline's
settlement does with a fresh answer, `CacheStage.save` (remember, then embed and write in the background).
A run ends when every lookup has returned and every background write is done; its rate is requests over that
wall time, and also over the CPU time the process used (all its threads): on a machine shared with other work
the second is the steadier estimate of what one core of our own would serve. Every run starts from an empty
SQLite cache (in memory) with one entry already in the questions' partition, so every lookup embeds: the miss
path the gateway benchmark's "deterministic" row measures.

Side by side, interleaved (each round runs every configuration once, in the same order):
- `serial`: one text per forward pass (`embed_batch=1`), the ablation that restores one-at-a-time embedding;
- `batched`: the gateway's settings (up to 32 texts per forward pass, 3 ms wait budget);
each on the embedder runtimes asked for (`torch`: sentence-transformers; `onnx`: ONNX Runtime, see
cache/onnx_runtime.py). The lookup's vector is handed to the store in every configuration.

Numbers on a machine shared with other work are noisy; compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from assets import offline_hub
from assets.datasets import sharegpt_first_turns
from cache import Embedder, SemanticCache, SQLiteStore
from gateway.ladder.apply import NORMAL
from gateway.pipeline.cache_lookup import CacheStage
from gateway.pipeline.context import RequestContext
from gateway.pipeline.meter import Outcome
from gateway.tenants.records import Principal
from gateway.tenants.store import TenantStore
from quotas.plans import Plan
from wire.chat_request import ChatCompletionRequest

MODES = {"serial": {"embed_batch": 1, "embed_wait_s": 0.0}, "batched": {"embed_batch": 32, "embed_wait_s": 0.003}}


def questions(n: int) -> list[str]:
    """`n` distinct short ShareGPT first turns: the kind of question API traffic repeats."""
    seen: dict[str, None] = {}
    for text in sharegpt_first_turns(limit=20_000):
        text = text.strip()
        if 10 <= len(text) <= 300:
            seen.setdefault(text, None)
        if len(seen) >= n:
            break
    return list(seen)


def context(store: TenantStore) -> RequestContext:
    if "bench" not in {t.name for t in store.list_tenants()}:
        store.create_tenant("bench", "standard")
    key, _ = store.issue_key("bench", name="bench")
    plan = Plan(name="standard", allowed_tiers=["mid"], default_tier="mid")
    return RequestContext("bench", Principal(key, store.get_tenant("bench")), plan, {}, time.time(),
                          time.perf_counter())


def outcome(text: str) -> Outcome:
    return Outcome(status="ok", http_status=200, error_code=None, input_tokens=12, output_tokens=24,
                   finish_reason="stop", text=f"an answer to: {text[:40]}", ttft_s=None, upstream_s=0.0,
                   busy_s=None, mean_logprob=None)


async def run(stage: CacheStage, ctx: RequestContext, seed: str, texts: list[str],
              concurrency: int) -> tuple[float, float, Counter]:
    """Requests per second and per CPU-second for `texts` sent `concurrency` at a time (after `seed`, untimed, so
    the partition is not empty), and how the lookups ended."""
    tier = SimpleNamespace(name="mid")
    statuses: Counter = Counter()

    async def request(text: str) -> None:
        req = ChatCompletionRequest.model_validate(
            {"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": text}]})
        lookup = await stage.lookup(ctx, req, tier, NORMAL)  # type: ignore[arg-type]
        statuses[lookup.status] += 1
        if lookup.status != "hit":
            stage.save(lookup, outcome(text), ())

    await request(seed)
    await stage.drain()
    statuses.clear()
    todo = iter(texts)

    async def client() -> None:
        for text in todo:
            await request(text)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    await stage.drain()
    return len(texts) / (time.perf_counter() - start), len(texts) / (time.process_time() - cpu), statuses


def new_stage(embedder: Embedder, store: TenantStore, mode: str) -> CacheStage:
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=100_000), embedder, **MODES[mode])  # type: ignore[arg-type]
    fleet = SimpleNamespace(model_version=lambda tier: "bench-model")
    return CacheStage(cache=cache, store=store, fleet=fleet)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=192, help="requests per run (a quarter of it at c=1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runtimes", default="torch,onnx")
    parser.add_argument("--modes", default="serial,batched")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this core (as the gateway bench)")
    args = parser.parse_args()
    offline_hub()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    embedders = {r: Embedder(runtime=r) for r in args.runtimes.split(",")}  # type: ignore[arg-type]
    for e in embedders.values():
        e.encode_one("warm up")
    texts = questions(args.requests + 1)
    seed, texts = texts[0], texts[1:]
    state = TenantStore(Path(tempfile.mkdtemp()) / "state.db")
    ctx = context(state)
    results: dict[tuple[str, str, int], list[float]] = {}
    per_cpu: dict[tuple[str, str, int], list[float]] = {}
    hits: Counter = Counter()
    for _ in range(args.rounds):
        for c in levels:
            for runtime, embedder in embedders.items():
                for mode in modes:
                    stage = new_stage(embedder, state, mode)
                    n = texts if c > 1 else texts[: max(8, len(texts) // 4)]
                    rate, cpu_rate, statuses = asyncio.run(run(stage, ctx, seed, n, c))
                    results.setdefault((runtime, mode, c), []).append(rate)
                    per_cpu.setdefault((runtime, mode, c), []).append(cpu_rate)
                    hits[(runtime, mode, c)] += statuses["hit"]
                    stage.cache.close()  # type: ignore[union-attr]
    print(f"{len(texts)} distinct questions ({statistics.mean(map(len, texts)):.0f} characters on average), "
          f"{args.rounds} interleaved rounds, cores {sorted(os.sched_getaffinity(0))}, load average "
          f"{os.getloadavg()[0]:.1f} at the end; median of rounds (each round's value in brackets).")
    for title, table in (("Deterministic misses per second (wall clock)", results),
                         ("Deterministic misses per CPU-second of the process", per_cpu)):
        print(f"\n{title}:\n")
        print("| embedder | mode | " + " | ".join(f"c={c}" for c in levels) + " |")
        print("|---|---|" + "---|" * len(levels))
        for runtime in embedders:
            for mode in modes:
                cells = [f"{statistics.median(table[(runtime, mode, c)]):.0f} "
                         f"({', '.join(f'{r:.0f}' for r in table[(runtime, mode, c)])})" for c in levels]
                print(f"| {runtime} | {mode} | " + " | ".join(cells) + " |")
    if sum(hits.values()):
        print(f"\n(semantic hits among the new questions, all rounds: {dict(hits)})")


if __name__ == "__main__":
    main()
