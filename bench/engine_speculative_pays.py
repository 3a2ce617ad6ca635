"""Whether the speculative tier drafts only where it pays (engine/draft_cost.py): one request or several, three
decoders side by side in one run.

`.venv/bin/python -m bench.engine_speculative_pays [--rounds 3] [--scenarios len1559,len60,streams1,streams16]
[--kinds always,costed,plain] [--temperature 0] [--output-len 128] [--max-batch 1]`

The `full` tier's engine as the product builds it (engine.launch.build_engine: dtype auto, the `mid` tier's int8 model
drafting, k = 4, `--max-batch` (the tier's: 1), one torch thread); per trial a fresh LLMEngine over the same runners,
with the decoder of each kind: `always` drafts whenever it can (costs=None: the decoder before the cost model), `costed`
the default (the cost model), `plain` none; `--max-batch 16` lets a step of 16 streams speculate (the cost model judging
the batch). Scenarios: `lenL`, one request whose chat prompt is L tokens (BENCHMARKS.md's text, then "Summarize the text
above."), answered in --output-len tokens (ignore_eos); `streamsN`, N ShareGPT first turns (<= 256 tokens,
bench.engine.load_prompts) at once, up to --output-len tokens or EOS. Sampled runs (--temperature > 0) use top_p 0.95
and seed i for request i. Kinds alternate, their order reversed every round; the median of the rounds is printed with
each round's time, the speculative steps and drafted and kept tokens of the last round, and the distinct outputs over
the rounds (one hash per kind: its answers repeat; the same hash as plain's: token for token plain decoding's).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

from assets import offline_hub
from bench.engine import MODEL_DIR, load_prompts
from bench.ledger_stores import cpu_model

offline_hub()
ROOT = Path(__file__).resolve().parents[1]


def digest(outs: list[list[int]]) -> str:
    return hashlib.md5(str(outs).encode()).hexdigest()[:8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scenarios", default="len1559,len60,streams1,streams16")
    ap.add_argument("--kinds", default="always,costed,plain")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=1)
    args = ap.parse_args()
    from engine.launch import DraftModel, build_engine
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.speculative import SpeculativeConfig, SpeculativeDecoder

    base, _ = build_engine(str(MODEL_DIR), MODEL_DIR.parent, dtype="auto", threads=1,
                           draft=DraftModel(str(MODEL_DIR), quantize="int8", k=4, max_batch=args.max_batch))
    assert base.speculative is not None
    target, draft, tok = base.model_runner, base.speculative.draft, base.tokenizer
    kinds, scenarios = args.kinds.split(","), args.scenarios.split(",")

    def chat(text: str) -> list[int]:
        return list(tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"])

    body = tok((ROOT / "BENCHMARKS.md").read_text())["input_ids"]

    def prompt_of(length: int) -> list[int]:
        n = max(length - 40, 1)
        while len(ids := chat(tok.decode(body[:n]) + "\n\nSummarize the text above.")) < length:
            n += 2
        return ids

    sharegpt = load_prompts(tok, max([int(s[7:]) for s in scenarios if s.startswith("streams")] or [1]), 256)
    prompts = {s: ([prompt_of(int(s[3:]))], True) if s.startswith("len") else (sharegpt[:int(s[7:])], False)
               for s in scenarios}

    def engine(kind: str) -> tuple[Any, Any]:
        spec = None
        if kind != "plain":
            config = SpeculativeConfig(k=4, max_batch=args.max_batch, **({"costs": None} if kind == "always" else {}))
            spec = SpeculativeDecoder(target, draft, config)
        return LLMEngine(target, tok, max_num_seqs=base.max_num_seqs, max_num_batched_tokens=512,
                         speculative=spec), spec

    async def trial(kind: str, ps: list[list[int]], ignore_eos: bool) -> tuple[float, int, str, tuple[int, ...]]:
        e, spec = engine(kind)
        e.start()

        async def one(i: int, ids: list[int]) -> list[int]:
            t = args.temperature
            params = SamplingParams(temperature=t, top_p=0.95 if t else 1.0, max_tokens=args.output_len,
                                    ignore_eos=ignore_eos, seed=i if t else None)
            made: list[int] = []
            async for out in e.generate(ids, params, cache_salt=f"t{i}"):
                made += out.token_ids
            return made

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
        took = time.perf_counter() - t0
        e.shutdown()
        counts = (spec.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0, 0)
        return took, sum(map(len, outs)), digest(outs), counts

    async def run() -> None:
        await trial(kinds[0], [prompt_of(60)], True)  # warm-up
        table: dict[tuple[str, str], list[Any]] = {}
        for r in range(args.rounds):
            for scenario in scenarios:
                ps, ignore_eos = prompts[scenario]
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    table.setdefault((scenario, kind), []).append(await trial(kind, ps, ignore_eos))
        print(f"CPU: {cpu_model()}; target {target.dtype}, draft int8, k=4, max_batch={args.max_batch}, 1 thread, "
              f"temperature {args.temperature}, <= {args.output_len} tokens, {args.rounds} rounds, load average "
              f"{os.getloadavg()[0]:.2f}\n")
        print("| scenario | decoder | time s (median) | rounds | tok/s | vs plain | spec steps, drafted, kept | "
              "outputs |\n|---|---|---|---|---|---|---|---|")
        for scenario in scenarios:
            plain = table.get((scenario, "plain"))
            plain_rate = statistics.median(n / t for t, n, _, _ in plain) if plain else None
            for kind in kinds:
                rows = table[(scenario, kind)]
                rate = statistics.median(n / t for t, n, _, _ in rows)
                length = f"{len(prompts[scenario][0][0])}-token prompt" if scenario.startswith("len") else "ShareGPT"
                print(f"| {scenario} ({length}) | {kind} | {statistics.median(t for t, *_ in rows):.2f} | "
                      f"{', '.join(f'{t:.2f}' for t, *_ in rows)} | {rate:.1f} | "
                      f"{f'{rate / plain_rate:.2f}x' if plain_rate else '-'} | {', '.join(map(str, rows[-1][3]))} | "
                      f"{', '.join(sorted({d for _, _, d, _ in rows}))} |", flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
