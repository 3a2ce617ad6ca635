"""The CPU torch fallback of attention (no native kernel) in a real prefill, this tree's against another version of
engine/attention.py, side by side in one process.

    TIERGATE_NATIVE_KERNELS=0 python -m bench.attention_fallback --baseline OLD.py [--prompts 8 32] [--threads 2]

e.g. with `git show 919de46:engine/attention.py > /tmp/attention_old.py` for the row-by-row gather. SmolLM2's fp32
runner (the torch ops: the native kernels are refused) prefills --prompts prompts of random lengths in
[--min-tokens, --max-tokens] in one step, once with each `paged_attention` (the model's reference swapped); the
table gives each prefill's seconds and whether the two gave the same top-20 log-probabilities to the bit. A
baseline prefill that would run past --baseline-limit seconds (estimated from the smaller ones: it grows about as
the square of the tokens) is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="another engine/attention.py to compare")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-limit", type=float, default=600.0, help="seconds a baseline prefill may take")
    args = ap.parse_args()
    if os.environ.get("TIERGATE_NATIVE_KERNELS") != "0":
        raise SystemExit("set TIERGATE_NATIVE_KERNELS=0: this measures the torch fallback")

    import torch

    from assets.model_source import DEFAULT_MODEL, prepare_model
    from engine.block_manager import BlockManager
    from engine.model_runner import ModelRunner
    from engine.models import llama
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from gateway.settings import Settings

    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("attention_baseline", args.baseline)
    baseline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = baseline  # its dataclass looks its module up
    spec.loader.exec_module(baseline)
    versions = {"baseline": baseline.paged_attention, "this tree": llama.paged_attention}

    model_dir = prepare_model(DEFAULT_MODEL, Settings().resolved_models_dir, progress=True)
    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=1 << 30)
    assert runner.decode_kernel is None, "the native kernels were loaded"
    gen = torch.Generator().manual_seed(0)

    def prefill(prompts: list[list[int]]) -> tuple[float, list]:
        """One step prefilling every prompt; (seconds, each prompt's top-20 log-probabilities)."""
        bm = BlockManager(runner.num_kv_blocks, runner.block_size)
        sched = Scheduler(bm, max_num_seqs=len(prompts), max_num_batched_tokens=sum(map(len, prompts)),
                          max_model_len=runner.max_model_len, eos_token_ids=set())
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
        seqs = [Sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
        for seq in seqs:
            sched.add_request(seq)
        out = sched.schedule()
        assert len(out.seqs) == len(prompts) and all(out.do_sample), "the prompts did not fit one step"
        start = time.perf_counter()
        runner.run(out)
        seconds = time.perf_counter() - start
        return seconds, [runner.last_logprobs[s.request_id] for s in seqs]

    print(f"{_cpu()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; SmolLM2-135M fp32, prompts of {args.min_tokens}-{args.max_tokens} tokens\n")
    print("| prompts | tokens | baseline (s) | this tree (s) | speed-up | same bits |\n|---|---|---|---|---|---|")
    prefill([[1, 2, 3]])  # warm-up
    cost = None  # baseline seconds per (token squared), from the last one measured
    for num in args.prompts:
        prompts = [[1, *torch.randint(2, runner.config.vocab_size, (n - 1,), generator=gen).tolist()]
                   for n in torch.randint(args.min_tokens, args.max_tokens + 1, (num,), generator=gen).tolist()]
        tokens = sum(map(len, prompts))
        square = sum(len(p) ** 2 for p in prompts)
        results = {}
        for name, fn in versions.items():
            if name == "baseline" and cost is not None and cost * square > args.baseline_limit:
                continue
            llama.paged_attention = fn
            try:
                results[name] = prefill(prompts)
            finally:
                llama.paged_attention = versions["this tree"]
        new_s, new_lp = results["this tree"]
        if "baseline" in results:
            old_s, old_lp = results["baseline"]
            cost = old_s / square
            print(f"| {num} | {tokens} | {old_s:.1f} | {new_s:.1f} | {old_s / new_s:.1f}x | {old_lp == new_lp} |",
                  flush=True)
        else:
            print(f"| {num} | {tokens} | skipped (~{cost * square:.0f} s estimated) | {new_s:.1f} | | |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


def _cpu() -> str:
    """The CPU's model name, family and model (what decides its vector paths), from /proc/cpuinfo where there is one."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if not fields:
        return platform.machine()
    return f"{fields.get('model name')} (family {fields.get('cpu family')}, model {fields.get('model')})"


if __name__ == "__main__":
    main()
