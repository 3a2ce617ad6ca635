"""Where a decode step's time goes: torch's profiler over steady decode steps of our engine.

`.venv/bin/python -m bench.engine_profile [--streams 16] [--prompt-len 256] [--quantize int8]`; with
TIERGATE_NATIVE_KERNELS=0 it profiles torch's attention (gather + SDPA) and layer ops that the native kernels
replace, with TIERGATE_ONEDNN=0 torch's nn.Linear instead of the oneDNN-packed layers.
Every stream's prompt is prefilled first; then --steps decode steps are timed and 5 more profiled
(the C++ kernels are not torch ops: their time is what the table's total leaves of the step).
"""

from __future__ import annotations

import argparse
import time

from assets import offline_hub

offline_hub()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--quantize", default=None, choices=["int8"])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.engine import MODEL_DIR, load_prompts
    from engine.block_manager import BlockManager
    from engine.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    runner = ModelRunner(MODEL_DIR, dtype="fp32", quantize=args.quantize)
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=args.streams,
                      max_num_batched_tokens=512, max_model_len=runner.max_model_len, eos_token_ids=set())
    params = SamplingParams(temperature=0, max_tokens=args.steps + 100, ignore_eos=True)
    for i, ids in enumerate(load_prompts(tok, args.streams, args.prompt_len)):
        sched.add_request(Sequence(f"r{i}", ids, params))

    def step() -> bool:
        out = sched.schedule()
        sched.postprocess(out, runner.run(out))
        return len(out.seqs) == args.streams and all(n == 1 for n in out.num_scheduled_tokens)

    while not step():  # prefill every prompt
        pass
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"decode step {dt * 1e3:.1f} ms, {args.streams / dt:.1f} tok/s ({args.streams} streams, "
          f"native kernel: {runner.decode_kernel is not None}, quantize: {args.quantize})")
    with torch.profiler.profile() as prof:
        for _ in range(5):
            step()
    print("per 5 steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
