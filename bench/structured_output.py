"""Structured output: what grammar-constrained decoding costs per token, with each library, and in our engine.

    .venv/bin/python -m bench.structured_output [--steps 300] [--streams 1,16] [--engine-tokens 256] [--reps 3]
                                                [--threads N (torch threads in part 2: 1 on a machine others load)]

The engine's library, llguidance, is a dependency; the two it is compared with are not:
`.venv/bin/pip install outlines-core` and `.venv/bin/pip install --no-deps xgrammar apache-tvm-ffi` (xgrammar
asks for triton, a GPU compiler it does not need on CPU). A library not installed is reported as such.

Part 1, the libraries (llguidance, xgrammar, outlines-core), each with SmolLM2's tokenizer (49,152 tokens) and
the same nested JSON schema (NESTED_SCHEMA: objects in an array in an object, enums, bounded integers and
strings) with the engine's separators, side by side in one run:
- compile: the time to turn one schema into what the library's matchers run on (a schema it has not seen), the
  same for "any JSON object" (json_object), and for HOSTILE_SCHEMA, 30 bytes a tenant could send (in a child
  process, abandoned after --hostile-timeout seconds);
- per token, at 1 and at 16 streams in lock-step: the library's work (computing each stream's allowed-token
  bitmask, advancing its matcher by the token) and applying the bitmasks to the logits (numpy's unpackbits and
  one masked_fill over [streams, V], as engine/grammar.py does, the same for every library), against what a
  token costs without a grammar: the engine's Sampler at temperature 0.7, seeded (softmax, multinomial), and a
  greedy argmax. The tokens are those of valid answers (json.dumps of instances of the schema, tokenized by
  SmolLM2's tokenizer, then EOS), so every step is one a real answer takes; a library must allow every one of
  them and refuse EOS before the answer is complete, or its wrong masks are counted. Each figure is the median
  step's, so that a step another process preempted does not count. llguidance and xgrammar are also run with
  their batched calls (a thread pool over the streams); outlines-core has none.

Part 2, our engine (fp32 SmolLM2 on this CPU, through LLMEngine.generate) at 1 and 16 concurrent requests,
greedy, prompts ShareGPT first turns cut to 64 tokens: decode tokens/s with `response_format` json_schema
(NESTED_SCHEMA; each answer ends where its JSON does, within --engine-tokens) and without it, each request then
making exactly as many tokens as its JSON answer did (EOS ignored), so both decode the same batch for as long.
Tokens/s counts the tokens after each request's first (its prefill's) over the time from the last first token to
the last token. The two run alternately, --reps times each; the median run of each is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import multiprocessing
import os
import platform
import queue
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from assets import offline_hub
from bench.grammar_libs import LIBRARIES, SEPARATORS, Lib

offline_hub()

MODEL_DIR = Path.home() / ".local/share/tiergate/models/smollm2-135m-instruct"

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["title", "language", "topics", "answer"], "additionalProperties": False,
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "language": {"type": "string", "enum": ["en", "zh", "es", "fr", "de", "other"]},
        "topics": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "required": ["name", "relevance"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 30},
                           "relevance": {"type": "integer", "minimum": 0, "maximum": 10}}}},
        "answer": {"type": "object", "required": ["short", "confident"], "additionalProperties": False,
                   "properties": {"short": {"type": "string", "maxLength": 80}, "confident": {"type": "boolean"}}},
    },
}
# 30 bytes: a string of up to 5,000 a-or-b then x; a compiler that unrolls the repetition pays for each one
HOSTILE_SCHEMA: dict[str, Any] = {"type": "string", "pattern": "(a|b){1,5000}x"}
WORDS = ("python", "error", "list", "sort", "fast", "memory", "cloud", "recipe", "travel", "budget", "essay", "poem",
         "history", "physics", "music", "code", "résumé", "données", "naïve", "東京", "привет")


def cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = sorted(set(re.findall(r"\b(avx512\w*|amx\w*|avx2)\b", info)))
    name = found[1].strip() if found else platform.processor() or "unknown"
    return f"{name}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none of avx2/avx512/amx'}"


def instances(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` valid instances of NESTED_SCHEMA, with words of several scripts."""
    rng = random.Random(seed)

    def text(limit: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))[:limit]

    return [{"title": text(60), "language": rng.choice(NESTED_SCHEMA["properties"]["language"]["enum"]),
             "topics": [{"name": text(30), "relevance": rng.randint(0, 10)} for _ in range(rng.randint(1, 3))],
             "answer": {"short": text(80), "confident": rng.random() < 0.5}} for _ in range(n)]


def variant(i: int) -> dict[str, Any]:
    """NESTED_SCHEMA with its properties renamed: a schema no library cache has seen."""
    s = copy.deepcopy(NESTED_SCHEMA)
    s["properties"] = {f"{k}_{i}": v for k, v in s["properties"].items()}
    s["required"] = [f"{k}_{i}" for k in s["required"]]
    return s


def load_tokenizer() -> tuple[Any, int, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    return tok, json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"], tok.eos_token_id


# ---- part 1 ----

def time_compile(lib: Lib, reps: int) -> tuple[float, float]:
    """Median ms to compile a new variant of NESTED_SCHEMA, and to compile json_object."""
    schema_ms, object_ms = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        lib.compile(variant(1000 + i))
        schema_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        lib.compile(None)
        object_ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(schema_ms), statistics.median(object_ms)


def _compile_hostile(name: str, results: Any) -> None:
    tok, vocab, eos = load_tokenizer()
    lib = LIBRARIES[name](tok, vocab, eos)
    results.put("ready")
    t0 = time.perf_counter()
    lib.compile(HOSTILE_SCHEMA)
    results.put((time.perf_counter() - t0) * 1e3)


def hostile_compile(name: str, timeout_s: float) -> str:
    """ms to compile HOSTILE_SCHEMA in a child process, or how long it ran before it was stopped."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_compile_hostile, args=(name, results), daemon=True)
    child.start()
    try:
        results.get(timeout=300)  # the tokenizer and the library's setup, not timed
        return f"{results.get(timeout=timeout_s):.1f}"
    except queue.Empty:
        return f"> {timeout_s * 1e3:.0f} (stopped)"
    finally:
        child.kill()
        child.join()


def apply_bitmask(logits: Any, bitmask: Any, vocab: int) -> None:
    """Every token whose bit is 0 set to -inf (bit j of word w is token 32w + j), as engine/grammar.py does."""
    import torch

    refused = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    logits.masked_fill_(torch.from_numpy(refused.view(np.bool_)), float("-inf"))


def run_streams(lib: Lib, compiled: Any, seqs: list[list[int]], vocab: int, eos: int,
                steps: int) -> tuple[float, float, float, float, int]:
    """`steps` lock-step steps of len(seqs) streams (each starts its answer again, with a new matcher, when done).
    Returns µs per stream-token (the median step's) of: greedy argmax, sampling (the engine's Sampler at
    temperature 0.7, seeded), the library's work (fill the bitmasks, advance the matchers) and applying the
    bitmasks; and the number of wrong masks (a token of the valid answer refused, or EOS allowed before the answer
    is complete)."""
    import torch

    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams

    k = len(seqs)
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    params = SamplingParams(temperature=0.7, seed=1)
    bitmask = torch.full((k, (vocab + 31) // 32), -1, dtype=torch.int32)
    ms = [lib.matcher(compiled) for _ in range(k)]
    pos = [0] * k
    wrong = 0
    argmax_s, sample_s, library_s, apply_s = [], [], [], []
    for _ in range(steps):
        work = logits.clone()
        t0 = time.perf_counter()
        lib.fill(ms, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(work, bitmask, vocab)
        t2 = time.perf_counter()
        logits.argmax(dim=-1).tolist()  # the runner's greedy shortcut, for the batch
        t3 = time.perf_counter()
        for i in range(k):
            sampler.sample(f"s{i}", logits[i], params)
        t4 = time.perf_counter()
        tokens = [seqs[i][pos[i]] for i in range(k)]
        allowed = work != float("-inf")  # [k, V] (the random logits are all finite)
        for i, token in enumerate(tokens):
            done = pos[i] == len(seqs[i]) - 1
            wrong += int(not allowed[i, token]) + int(not done and bool(allowed[i, eos]))
        t5 = time.perf_counter()
        for i, token in enumerate(tokens):
            lib.accept(ms[i], token)
            pos[i] += 1
            if pos[i] == len(seqs[i]):
                pos[i] = 0
                ms[i] = lib.matcher(compiled)
        t6 = time.perf_counter()
        library_s.append(t1 - t0 + t6 - t5)
        apply_s.append(t2 - t1)
        argmax_s.append(t3 - t2)
        sample_s.append(t4 - t3)
    us = 1e6 / k
    return (statistics.median(argmax_s) * us, statistics.median(sample_s) * us, statistics.median(library_s) * us,
            statistics.median(apply_s) * us, wrong)


def part1(args: argparse.Namespace, tok: Any, vocab: int, eos: int) -> None:
    answers = [json.dumps(x, separators=SEPARATORS, ensure_ascii=False) for x in instances(16)]
    seqs = [tok(a, add_special_tokens=False)["input_ids"] + [eos] for a in answers]
    print(f"\nPart 1: 16 valid answers of NESTED_SCHEMA, {statistics.mean(map(len, seqs)):.0f} tokens each on "
          f"average; {args.steps} steps per row; torch on 1 thread")
    print("\n| library | compile schema (ms) | compile json_object (ms) | compile HOSTILE_SCHEMA (ms) | streams | "
          "greedy µs/token | sampled µs/token | library µs/token | apply µs/token | greedy+grammar / greedy | "
          "sampled+grammar / sampled | wrong masks |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, make in LIBRARIES.items():
        if importlib.util.find_spec(name.replace("-", "_")) is None:
            print(f"| {name} | not installed (see the module docstring) |", flush=True)
            continue
        hostile = hostile_compile(name, args.hostile_timeout)
        for batched in (False, True) if name != "outlines-core" else (False,):
            lib = make(tok, vocab, eos, batched=batched)
            schema_ms, object_ms = time_compile(lib, args.compile_reps)
            compiled = lib.compile(NESTED_SCHEMA)
            for k in args.streams:
                streams = [seqs[i % len(seqs)] for i in range(k)]
                greedy, sampled, library, apply, wrong = run_streams(lib, compiled, streams, vocab, eos, args.steps)
                grammar = library + apply
                print(f"| {lib.name} | {schema_ms:.1f} | {object_ms:.1f} | {hostile} | {k} | {greedy:.0f} | "
                      f"{sampled:.0f} | {library:.0f} | {apply:.0f} | {(greedy + grammar) / greedy:.1f} | "
                      f"{(sampled + grammar) / sampled:.2f} | {wrong} |", flush=True)


# ---- part 2 ----

def part2(args: argparse.Namespace, tok: Any) -> None:
    import torch

    from bench.engine import load_prompts
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    runner = ModelRunner(MODEL_DIR, dtype="fp32")
    prompts = load_prompts(tok, max(args.streams), 64)
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": NESTED_SCHEMA, "strict": True}}
    print(f"\nPart 2: our engine, fp32, greedy, torch on {torch.get_num_threads()} threads; median of {args.reps} "
          "runs of each, alternated")
    print("\n| streams | tokens per answer | unconstrained tok/s | json_schema tok/s | json_schema / unconstrained | "
          "json_schema answers complete and valid |")
    print("|---:|---:|---:|---:|---:|---:|")
    engine = LLMEngine(runner, tok, max_num_seqs=max(args.streams), max_num_batched_tokens=64 * max(args.streams))
    engine.start()
    try:
        for k in args.streams:
            rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
            valid = total = 0
            for _ in range(args.reps):
                params = [SamplingParams(temperature=0.0, max_tokens=args.engine_tokens, response_format=fmt)] * k
                texts, counts, rate = asyncio.run(_generate(engine, prompts[:k], params))
                rates["json_schema"].append(rate)
                valid += sum(_valid(t) for t in texts)
                total += k
                # the same prompts, each making as many tokens as its JSON answer did
                params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in counts]
                rates["unconstrained"].append(asyncio.run(_generate(engine, prompts[:k], params))[2])
            free, constrained = statistics.median(rates["unconstrained"]), statistics.median(rates["json_schema"])
            print(f"| {k} | {statistics.mean(counts):.0f} | {free:.1f} | {constrained:.1f} | {constrained / free:.2f} "
                  f"| {valid}/{total} |", flush=True)
    finally:
        engine.shutdown()


async def _generate(engine: Any, prompts: list[list[int]], params: list[Any]) -> tuple[list[str], list[int], float]:
    """Every prompt at once: (texts, tokens made by each, decode tokens/s: the tokens after each request's first,
    which its prefill made, over the time from the last first token to the last token)."""
    first: list[float] = []
    last: list[float] = []

    async def one(ids: list[int], p: Any) -> tuple[str, int]:
        parts: list[str] = []
        n = 0
        async for out in engine.generate(ids, p):
            if n == 0:
                first.append(time.perf_counter())
            parts.append(out.text)
            n = out.num_output_tokens
        last.append(time.perf_counter())
        return "".join(parts), n

    results = await asyncio.gather(*(one(ids, p) for ids, p in zip(prompts, params, strict=True)))
    counts = [n for _, n in results]
    return [t for t, _ in results], counts, sum(n - 1 for n in counts) / (max(last) - max(first))


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="lock-step steps per row of part 1")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--compile-reps", type=int, default=5)
    parser.add_argument("--hostile-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--engine-tokens", type=int, default=256,
                        help="max_tokens of a json_schema request in part 2 (256: every NESTED_SCHEMA answer fits)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each cell of part 2")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in part 2")
    parser.add_argument("--skip", choices=["libraries", "engine"], default=None)
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    import torch

    tok, vocab, eos = load_tokenizer()
    print(f"CPU: {cpu_model()}; load average at start {os.getloadavg()[0]:.2f}; python {platform.python_version()}; "
          f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    if args.skip != "libraries":
        torch.set_num_threads(1)  # one stream's work is one thread's (the batched calls bring their own pools)
        part1(args, tok, vocab, eos)
    if args.skip != "engine":
        part2(args, tok)


if __name__ == "__main__":
    main()
