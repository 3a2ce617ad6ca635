"""What each of the engine's CPU speed-ups is worth: one decode step with each of them undone, side by side.

`.venv/bin/python -m bench.engine_ablations [--streams 16] [--prompt-len 512] [--quantize int8]`
In one process, on the same prompts, the median time of a decode step for: the engine as built; its decode
steps through the model's Python layers instead of one native call (engine/decode_step.py); then, through the
Python layers, its layer steps as torch ops instead of the fused C++ ones, and (int8) the int8 tier's
per-token steps as torch ops; (fp32) torch's nn.Linear (MKL) instead of the oneDNN-packed layers; and the
engine's steps on a second thread (as the engine loop runs them) with the main thread's OpenMP pool kept, then
released. Each variant prefills its prompts, then times --steps decode steps; the variants run in --rounds
rounds, and the table gives the median over rounds, next to the linear layers alone (the ceiling
bench/engine.py uses).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from assets import offline_hub

offline_hub()


def decode_ms(runner: Any, prompts: list[list[int]], steps: int) -> float:
    """Median ms of a decode step once every prompt is prefilled."""
    from engine.block_manager import BlockManager
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=len(prompts),
                      max_num_batched_tokens=512, max_model_len=runner.max_model_len, eos_token_ids=set())
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(Sequence(f"r{i}", ids, params))
    times = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        t0 = time.perf_counter()
        sched.postprocess(out, runner.run(out))
        if len(out.seqs) == len(prompts) and all(n == 1 for n in out.num_scheduled_tokens):
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3  # the first decode steps warm up


def on_second_thread(fn: Callable[[], float]) -> float:
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--quantize", default=None, choices=["int8"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.engine import MODEL_DIR, ceiling, engine_linears, load_prompts
    from engine.int8_dynamic import Int8DynamicLinear
    from engine.layer_ops import TorchLayerOps
    from engine.model_runner import ModelRunner
    from engine.openmp import release_thread_pool

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = load_prompts(tok, args.streams, args.prompt_len)
    runner = ModelRunner(MODEL_DIR, dtype="fp32", quantize=args.quantize)
    native_ops, native_decode = runner.model.ops, runner.native_decode

    def measure(r: Any = runner) -> float:
        return decode_ms(r, prompts, args.steps)

    def python_layers() -> float:
        runner.native_decode = None
        try:
            return measure()
        finally:
            runner.native_decode = native_decode

    def torch_layer_ops() -> float:
        runner.model.ops = TorchLayerOps()
        try:
            return python_layers()
        finally:
            runner.model.ops = native_ops

    def int8_steps_in_torch() -> float:
        int8 = [m for m in runner.model.modules() if isinstance(m, Int8DynamicLinear)]
        kernels = [m.kernels for m in int8]
        for m in int8:
            m.kernels = None
        try:
            return python_layers()  # the native decode step calls the fused steps itself
        finally:
            for m, k in zip(int8, kernels, strict=True):
                m.kernels = k

    def released_then_second_thread() -> float:
        release_thread_pool()
        return on_second_thread(measure)

    variants: dict[str, Callable[[], float]] = {"the engine, main thread": measure}
    if native_decode is not None:
        variants["decode steps through the Python layers"] = python_layers
    variants["layer steps as torch ops (Python layers)"] = torch_layer_ops
    if args.quantize == "int8":
        variants["int8 per-token steps as torch ops (Python layers)"] = int8_steps_in_torch
    else:
        os.environ["TIERGATE_ONEDNN"] = "0"
        mkl = ModelRunner(MODEL_DIR, dtype="fp32")
        del os.environ["TIERGATE_ONEDNN"]
        variants["torch's nn.Linear (MKL) instead of oneDNN"] = lambda: measure(mkl)
    variants["second thread, main thread's OpenMP pool kept"] = lambda: on_second_thread(measure)
    variants["second thread, main thread's pool released first"] = released_then_second_thread

    results: dict[str, list[float]] = {name: [] for name in variants}
    ceilings = []
    for r in range(args.rounds):
        for name, fn in variants.items():
            results[name].append(fn())
            print(f"round {r + 1}: {name}: {results[name][-1]:.1f} ms", flush=True)
        ceilings.append(args.streams / ceiling(engine_linears(runner), runner, args.streams, 10, native_decode) * 1e3)

    print(f"\nthreads={args.threads} streams={args.streams} prompt_len<={args.prompt_len} "
          f"quantize={args.quantize} median of {args.rounds} rounds\n")
    print("| decode step | ms | vs the engine |\n|---|---|---|")
    base = statistics.median(results["the engine, main thread"])
    print(f"| the engine's linear layers alone (ceiling, best of 10 a round) | {min(ceilings):.1f} | "
          f"{min(ceilings) / base:.2f}x |")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
