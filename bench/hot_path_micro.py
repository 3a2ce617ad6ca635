"""Single-function timings of the request path's small costs, each beside what it replaced, in one run.

    .venv/bin/python -m bench.hot_path_micro [--repeat 7] [--cpu 1]

What `bench.gateway_profile` pointed at, timed alone (best of `--repeat` runs of `timeit`, in µs per call):

- token counts of a 120-character question: `tokenizers`' `encode` (a whole Encoding, asked its length) against
  the gateway's word-by-word count (gateway/bpe_words.py) with its words remembered, and the word count's worst
  case, text made only of words it has never seen, at 2,000 and 8,000 characters;
- a stream chunk from a tier read with `json.loads` against msgspec's decoder (tiers/client.py);
- an event the gateway streams encoded with `json.dumps` against msgspec (wire/responses.py `sse`);
- a prometheus-client child looked up with `labels()` at every call against the one remembered
  (gateway/metrics.py `GatewayMetrics.child`);
- `TierSpec.version_name` read through pydantic's private-attribute `__getattr__` against the property that reads
  `__pydantic_private__` (tiers/catalogue.py);
- a tier's stream chunk metered (gateway/pipeline/meter.py `Meter.add`, per chunk of a 10-chunk answer) without an
  output cap against with one: the check every chunk pays that the tier has not streamed past the request's
  `max_tokens` (there is nothing it replaced: "before" is the meter without it);
- a chat body with a 29 KB response_format schema (hostile_tenant's: an object of 1,000 integer properties) parsed
  by the gateway (`parse_request`, on its event loop) with the schema's intersection count always walked against
  walked only where its JSON names allOf, oneOf or $ref (wire/schema_alternatives.py `may_intersect`).

Pinned to one CPU (`--cpu`, the last one by default) so the figures are one core's, as the gateway's are in
bench/gateway.py. Prints the CPU model and flags and Python's version with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import string
import timeit
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter
from tokenizers import Tokenizer

from bench.structured_output import cpu_model
from gateway.bpe_words import ByteLevelWords
from gateway.config_files import load_yaml
from gateway.metrics import GatewayMetrics
from gateway.pipeline.handle import parse_request
from gateway.pipeline.meter import Meter
from gateway.settings import Settings
from tiers.catalogue import TierCatalogue
from wire import response_format
from wire.responses import sse

QUESTION = "How do I make a Python script read a CSV file, skip the header row, and sum the third column quickly?"


def best_us(fn: Callable[[], Any], repeat: int, number: int) -> float:
    """The fastest of `repeat` runs of `number` calls, in µs per call."""
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e6


def unseen_words(n_chars: int, seed: int) -> str:
    """Words of random letters, none likely seen before: the word count's worst case."""
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 11))))
    return " ".join(words)[:n_chars]


def token_rows(tokenizer: Tokenizer, repeat: int) -> list[tuple[str, float, float]]:
    words = ByteLevelWords.for_tokenizer(tokenizer)
    assert words is not None, "the tokenizer is not GPT-2's kind: the word count does not apply"
    question = QUESTION[:120]
    assert words.count(question) == len(tokenizer.encode(question, add_special_tokens=False).ids)
    rows = [("token count, 120-character question (words remembered)",
             best_us(lambda: len(tokenizer.encode(question, add_special_tokens=False).ids), repeat, 2000),
             best_us(lambda: words.count(question), repeat, 2000))]
    for n in (2000, 8000):
        texts = iter([unseen_words(n, seed) for seed in range(repeat + 1)])  # each timed call sees new words
        fresh = ByteLevelWords(tokenizer)

        def cold(texts: Any = texts, fresh: ByteLevelWords = fresh) -> int:
            fresh._counts.clear()  # nothing remembered
            return fresh.count(next(texts))

        encoded = iter([unseen_words(n, 10_000 + seed) for seed in range(repeat + 1)])  # new text for encode too

        def cold_encode(encoded: Any = encoded) -> int:  # (encode caches words it has seen: never the same text)
            return len(tokenizer.encode(next(encoded), add_special_tokens=False).ids)

        rows.append((f"token count, {n:,} characters of words never seen", best_us(cold_encode, repeat, 1),
                     best_us(cold, repeat, 1)))
    return rows


def json_rows(repeat: int) -> list[tuple[str, float, float]]:
    chunk = {"id": "chatcmpl-5f1d2c", "object": "chat.completion.chunk", "created": 1764660000, "model": "full",
             "choices": [{"index": 0, "delta": {"content": " column"}, "finish_reason": None}]}
    raw = json.dumps(chunk).encode()
    decode = msgspec.json.Decoder().decode
    assert decode(raw) == json.loads(raw)
    assert sse(chunk) == b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return [("a tier's stream chunk decoded", best_us(lambda: json.loads(raw), repeat, 20000),
             best_us(lambda: decode(raw), repeat, 20000)),
            ("an event to the client encoded (`sse`)",
             best_us(lambda: b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n", repeat, 20000),
             best_us(lambda: sse(chunk), repeat, 20000))]


def metric_rows(repeat: int) -> list[tuple[str, float, float]]:
    registry = CollectorRegistry()
    counter = Counter("bench_requests", "Requests.", ["tier", "version", "result"], registry=registry)
    metrics = GatewayMetrics.__new__(GatewayMetrics)
    metrics._children = {}  # only what `child` uses: the rest of GatewayMetrics registers every series
    return [("prometheus child, then inc()", best_us(lambda: counter.labels("full", "v1", "ok").inc(), repeat, 20000),
             best_us(lambda: metrics.child(counter, "full", "v1", "ok").inc(), repeat, 20000))]


def spec_rows(repeat: int) -> list[tuple[str, float, float]]:
    catalogue = load_yaml(Settings().tiers_file, TierCatalogue)
    spec = next(iter(catalogue.tiers.values()))
    assert spec.version_name == spec._version  # type: ignore[attr-defined]
    return [("TierSpec.version_name read", best_us(lambda: spec._version, repeat, 20000),  # type: ignore[attr-defined]
             best_us(lambda: spec.version_name, repeat, 20000))]


def meter_rows(repeat: int) -> list[tuple[str, float, float]]:
    chunk = {"id": "chatcmpl-5f1d2c", "object": "chat.completion.chunk", "created": 1764660000, "model": "full",
             "choices": [{"index": 0, "delta": {"content": " column"}, "finish_reason": None}]}

    def answer(cap: int | None) -> Callable[[], None]:
        def metered() -> None:
            meter = Meter(0.0, counted_input=12, output_cap=cap)
            for _ in range(10):
                meter.add(chunk)
            assert not meter.overran
        return metered

    return [("a stream chunk metered, without / with the output cap's check (µs a chunk)",
             best_us(answer(None), repeat, 2000) / 10, best_us(answer(64), repeat, 2000) / 10)]


def schema_rows(repeat: int) -> list[tuple[str, float, float]]:
    schema = {"type": "object", "additionalProperties": False,
              "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    body = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 16,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "strict": True, "schema": schema}}}).encode()
    shortcut = response_format.may_intersect
    response_format.may_intersect = lambda text: True  # type: ignore[assignment]  # the count always walked
    try:
        before = best_us(lambda: parse_request(body), repeat, 50)
    finally:
        response_format.may_intersect = shortcut
    return [(f"a chat body with a {len(body) // 1024} KB response_format schema parsed", before,
             best_us(lambda: parse_request(body), repeat, 50))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7, help="timeit runs per figure; the fastest is kept [7]")
    parser.add_argument("--cpu", type=int, default=None, help="the CPU to pin to [the last one]")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    cpu = args.cpu if args.cpu is not None else cpus[-1]
    os.sched_setaffinity(0, {cpu})
    settings = Settings()
    model_dir = settings.resolved_models_dir / "smollm2-135m-instruct"
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows = (token_rows(tokenizer, args.repeat) + json_rows(args.repeat) + metric_rows(args.repeat)
            + spec_rows(args.repeat) + meter_rows(args.repeat) + schema_rows(args.repeat))
    print(f"`python -m bench.hot_path_micro --repeat {args.repeat}` — {cpu_model()}; pinned to CPU {cpu}; Python "
          f"{platform.python_version()}; best of {args.repeat} timeit runs, µs per call\n")
    print("| what | before (what it replaced) | now | ratio |")
    print("|---|---|---|---|")
    for what, before, now in rows:
        print(f"| {what} | {before:,.2f} | {now:,.2f} | {before / now:.1f}x |")


if __name__ == "__main__":
    main()
