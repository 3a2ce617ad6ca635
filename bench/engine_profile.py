"""Where a decode step's time goes: torch's profiler over steady decode steps of our engine.

`.venv/bin/python -m bench.engine_profile [--streams 16] [--prompt-len 256] [--dtype fp32|bf16] [--quantize int8]`; with
TIERGATE_NATIVE_KERNELS=0 it profiles torch's attention (gather + SDPA) and layer ops that the native kernels
replace, with TIERGATE_ONEDNN=0 torch's nn.Linear instead of the oneDNN-packed layers.
Every stream's prompt is prefilled first; then --steps decode steps are timed and 5 more profiled
(the C++ kernels are not torch ops: their time is what the table's total leaves of the step). With the native
kernels, the step's decode attention is also timed alone: every layer's call on the step's own block tables and
context lengths, the share of a step that reads the KV cache (which no linear-layer ceiling counts).
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
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--quantize", default=None, choices=["int8"])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.engine import MODEL_DIR, load_prompts
    from engine.block_manager import BlockManager
    from engine.model_runner import DEFAULT_KV_CACHE_BYTES, ModelRunner
    from engine.models.llama import LlamaConfig
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    # every stream's whole sequence at once, as bench.engine sizes it: the default cache holds 11,800 fp32 tokens,
    # fewer than 64 streams of 512-token prompts, and then the prefill loop below never sees them all decoding
    cfg = LlamaConfig.from_dir(MODEL_DIR)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, fp32 at most
    need = args.streams * (args.prompt_len + args.steps + 100) * per_token
    runner = ModelRunner(MODEL_DIR, dtype=args.dtype, quantize=args.quantize,
                         kv_cache_bytes=max(DEFAULT_KV_CACHE_BYTES, need))
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
    print(f"decode step {dt * 1e3:.1f} ms, {args.streams / dt:.1f} tok/s ({args.streams} streams, {args.dtype}, "
          f"native kernel: {runner.decode_kernel is not None}, quantize: {args.quantize})")
    if runner.decode_kernel is not None:
        attention_alone(runner, sched, args.steps, dt)
    with torch.profiler.profile() as prof:
        for _ in range(5):
            step()
    print("per 5 steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def attention_alone(runner: object, sched: object, steps: int, step_s: float) -> None:
    """Time the next step's decode attention alone, every layer, on its real block tables and lengths."""
    import torch

    out = sched.schedule()
    _, _, meta, _ = runner._prepare(out.seqs, out.num_scheduled_tokens)
    cfg = runner.config
    q = torch.randn(len(out.seqs), cfg.num_attention_heads, cfg.head_dim)
    scale = cfg.head_dim ** -0.5

    def layers() -> None:
        for layer in runner.kv_cache:
            runner.decode_kernel.paged_decode_attention(q, layer[0], layer[1], meta.decode_block_tables,
                                                        meta.decode_context_lens, scale)

    layers()
    t0 = time.perf_counter()
    for _ in range(steps):
        layers()
    dt = (time.perf_counter() - t0) / steps
    ctx = meta.decode_context_lens.float().mean().item()
    print(f"decode attention alone ({cfg.num_hidden_layers} layers, mean context {ctx:.0f} tokens, KV cache "
          f"{runner.kv_cache.dtype}): {dt * 1e3:.1f} ms, {dt / step_s:.0%} of a step")
    sched.postprocess(out, runner.run(out))


if __name__ == "__main__":
    main()
