"""Speculative decoding against plain decoding, side by side in one run (issue 23, point 2).

`.venv/bin/python -m bench.engine_speculative` (see --help). Two engines on the same target model are loaded
at once: plain, and with a draft (default: the int8 model, the `mid` tier's, drafting for the `full` tier's
model); runs alternate between them --rounds times and the median is kept. Per stream count and sampling mode:
tokens/s of each, their ratio, the share of drafted tokens kept, and, for greedy requests, how many answers are
token for token the plain engine's, beside how many of the plain engine's own answers are the same when each
prompt runs alone (where that count falls short, the dtype's rounding depends on which rows share a step, as
bf16's does, and speculation's unequal answers are that rounding, not the acceptance rule). Prompts are ShareGPT
first turns in the chat template; answers end at EOS or --output-len tokens. `--max-batch` above the stream
counts makes every step speculate, to show where it stops paying; the tier's default (4) turns it off above 4
sequences.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from assets import offline_hub
from bench.engine import MODEL_DIR, load_prompts
from bench.ledger_stores import cpu_model

offline_hub()


def run(engine: Any, prompts: list[list[int]], temperature: float, output_len: int) -> tuple[float, list[list[int]]]:
    """Every prompt at once; tokens/s over the run and each answer's tokens."""
    from engine.sampling_params import SamplingParams

    async def one(i: int, ids: list[int]) -> list[int]:
        params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=output_len,
                                seed=i if temperature else None)
        made: list[int] = []
        async for out in engine.generate(ids, params):
            made += out.token_ids
        return made

    async def all_() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    t0 = time.perf_counter()
    answers = asyncio.run(all_())
    return sum(map(len, answers)) / (time.perf_counter() - t0), answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", help="the target's dtype (the full tier's: auto)")
    ap.add_argument("--draft", default=str(MODEL_DIR), help="the draft model's directory")
    ap.add_argument("--draft-quantize", default="int8", help="int8, or none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from engine.launch import DraftModel, build_engine
    from engine.model_runner import resolve_dtype

    torch.set_num_threads(args.threads)
    levels = [int(n) for n in args.streams.split(",")]
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = load_prompts(tok, max(levels), args.prompt_len)
    models_dir = MODEL_DIR.parent
    quantize = None if args.draft_quantize == "none" else args.draft_quantize
    draft = DraftModel(args.draft, quantize=quantize, k=args.k, max_batch=args.max_batch)
    plain, _ = build_engine(str(MODEL_DIR), models_dir, dtype=args.dtype, threads=args.threads)
    spec, _ = build_engine(str(MODEL_DIR), models_dir, dtype=args.dtype, threads=args.threads, draft=draft)
    for e in (plain, spec):
        e.start()
        run(e, prompts[:1], 0.0, 8)  # warm-up
    print(f"CPU: {cpu_model()}; target {resolve_dtype(args.dtype, 'cpu')}, draft {Path(args.draft).name} "
          f"{quantize or 'unquantized'} ({resolve_dtype('auto', 'cpu', quantize)}), k={args.k}, "
          f"max_batch={args.max_batch}, {args.threads} threads, output <= {args.output_len} tokens\n")
    print("| streams | sampling | plain tok/s | speculative tok/s | speculative / plain | drafts kept | "
          "greedy answers equal | plain alone = together |\n|---|---|---|---|---|---|---|---|")
    for n in levels:
        for temperature in (0.0, 0.8):
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            kept_before = spec.stats()
            equal = ""
            for _ in range(args.rounds):
                for name, engine in (("plain", plain), ("spec", spec)):
                    rate, answers = run(engine, prompts[:n], temperature, args.output_len)
                    rates[name].append(rate)
                    if temperature == 0.0:
                        if name == "plain":
                            expected = answers
                        else:
                            equal = f"{sum(a == b for a, b in zip(answers, expected, strict=True))} of {n}"
            invariant = "—"
            if temperature == 0.0 and n > 1:
                alone = [run(plain, [prompt], 0.0, args.output_len)[1][0] for prompt in prompts[:n]]
                invariant = f"{sum(a == b for a, b in zip(alone, expected, strict=True))} of {n}"
            s = spec.stats()
            drafted = s.num_draft_tokens_total - kept_before.num_draft_tokens_total
            kept = (s.num_accepted_draft_tokens_total - kept_before.num_accepted_draft_tokens_total) / max(drafted, 1)
            p, q = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            print(f"| {n} | {'greedy' if temperature == 0 else 'T=0.8, top_p=0.95'} | {p:.1f} | {q:.1f} | "
                  f"{q / p:.2f}x | {kept:.0%}{'' if drafted else ' (no step speculated)'} | {equal or '—'} | "
                  f"{invariant} |",
                  flush=True)
    for e in (plain, spec):
        e.shutdown()


if __name__ == "__main__":
    main()
