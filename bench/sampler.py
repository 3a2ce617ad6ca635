"""The sampler's cost per sampled token, the rule it replaced beside it, on real SmolLM2 logits (issue 23).

`.venv/bin/python -m bench.sampler` (see --help). Logits come from SmolLM2-135M-Instruct (fp32, transformers)
over ShareGPT first turns in the chat template: the last --positions positions of each of --prompts prompts,
so every row is a distribution the model gives inside a real answer's context. Per sampling setting, each row is
turned into a token both ways, alternating, and the median time per token is kept:

- before: the whole vocabulary sorted for top-p (`torch.sort`) and `torch.multinomial` (the sampler until
  2026-12-02);
- now: `Sampler.distribution` (top-p looks at the 256 likeliest tokens first) and `Sampler.draw`.

It also counts the rows whose distributions differ between the two (expected 0: the same probabilities, only
found faster) and the rows where 256 candidates were not enough.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from assets import offline_hub
from bench.engine import MODEL_DIR, load_prompts
from bench.ledger_stores import cpu_model

offline_hub()

SETTINGS = [  # (label, temperature, top_k, top_p)
    ("T=0.8, top_p=0.95", 0.8, 0, 0.95),
    ("T=1.0, top_p=0.9", 1.0, 0, 0.9),
    ("T=0.7, top_k=50, top_p=0.9", 0.7, 50, 0.9),
    ("T=1.0 (no top-p)", 1.0, 0, 1.0),
    ("T=1.5, top_p=0.99", 1.5, 0, 0.99),
]


def real_logits(num_prompts: int, positions: int, threads: int) -> list[Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in load_prompts(tok, num_prompts, 256):
            logits = model(torch.tensor([ids])).logits[0].float()
            rows += list(logits[-positions:])
    return rows


def before(logits: Any, params: Any, gen: Any) -> int:
    """The rule the sampler had, for comparison only: top-p by sorting the whole vocabulary, torch's multinomial."""
    import torch

    return int(torch.multinomial(distribution_by_sort(logits, params), 1, generator=gen))


def distribution_by_sort(logits: Any, params: Any) -> Any:
    """The sampler's distribution with top-p taken the way it was: temperature and top-k are the sampler's own
    (unchanged), top-p sorts the whole vocabulary."""
    from engine.sampler import Sampler

    probs = Sampler.distribution(logits, dataclasses.replace(params, top_p=1.0))
    return nucleus_by_sort(probs, params.top_p) if params.top_p < 1.0 else probs


def nucleus_by_sort(probs: Any, top_p: float) -> Any:
    """Top-p on `probs` [V] as the rule states it, over the whole vocabulary sorted (tests/engine/test_sampler.py
    holds the sampler to it)."""
    import torch

    sorted_probs, sorted_idx = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, sorted_idx, sorted_probs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--positions", type=int, default=16, help="logit rows per prompt (its last positions)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import numpy as np
    import torch

    from engine.sampler import TOP_P_FIRST, Sampler
    from engine.sampling_params import SamplingParams

    rows = real_logits(args.prompts, args.positions, args.threads)
    print(f"CPU: {cpu_model()}; {args.threads} torch threads; {len(rows)} logit rows of SmolLM2-135M-Instruct "
          f"(vocabulary {rows[0].numel():,})\n")
    print("| setting | before µs/token | now µs/token | before / now | distributions differing | "
          f"rows past {TOP_P_FIRST} candidates |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)  # the old rule's (torch's multinomial)
    seeded = np.random.Generator(np.random.PCG64(0))  # a seeded request's, as the sampler now draws (Sampler.generator)
    for label, temperature, top_k, top_p in SETTINGS:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1)
        times: dict[str, list[float]] = {"before": [], "now": []}
        differing = wide = 0
        for row in rows:
            for name in ("before", "now"):
                t0 = time.perf_counter()
                if name == "before":
                    before(row, params, gen)
                else:
                    Sampler.draw(Sampler.distribution(row, params), seeded)
                times[name].append(time.perf_counter() - t0)
            now = Sampler.distribution(row, params)
            differing += not torch.equal(now, distribution_by_sort(row, params))
            wide += top_p < 1.0 and int((now > 0).sum()) >= TOP_P_FIRST
        b, n = statistics.median(times["before"]) * 1e6, statistics.median(times["now"]) * 1e6
        print(f"| {label} | {b:.0f} | {n:.0f} | {b / n:.1f}x | {differing} of {len(rows)} | {wide} |", flush=True)


if __name__ == "__main__":
    main()
