"""The decode-attention kernel alone, side by side with another version of its source, in one process.

`.venv/bin/python -m bench.attention_kernel --baseline OLD.cpp [--streams 16] [--context 165]`
e.g. with `git show REV:engine/kernels/paged_decode_attention.cpp > /tmp/old.cpp` for the kernel at REV.
Both are built (the baseline as its own extension, once) and timed alternately on the same query and cache:
one step's worth of calls (--layers layers, each with its own K/V cache, blocks in random order as in a busy
cache), for the fp32 and the bf16 cache; the table gives the median of --repeats steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="another paged_decode_attention.cpp to compare")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--context", type=int, default=165, help="tokens cached per stream")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    import torch
    from torch.utils.cpp_extension import load_inline

    from engine.kernels import native

    torch.set_num_threads(args.threads)
    ours = native.load()
    if ours is None:
        raise SystemExit("the native kernels cannot be built here")
    build = Path(tempfile.gettempdir()) / "tiergate-attention-baseline"
    build.mkdir(exist_ok=True)
    baseline = load_inline(name="tiergate_attention_baseline", cpp_sources=[args.baseline.read_text()],
                           functions=["paged_decode_attention"], extra_cflags=native.FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    block_size = 16
    per_stream = -(-args.context // block_size)
    num_blocks = args.streams * per_stream
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(args.streams, per_stream)
    lens = torch.full((args.streams,), args.context, dtype=torch.long)
    q = torch.randn(args.streams, args.heads, args.head_dim, generator=gen)
    print(f"{args.streams} streams x {args.context} cached tokens, {args.layers} layers, heads {args.heads}/"
          f"{args.kv_heads}x{args.head_dim}, {args.threads} threads; median of {args.repeats}\n")
    print("| cache | baseline (ms a step) | this kernel (ms a step) | speed-up |\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        shape = (num_blocks, block_size, args.kv_heads, args.head_dim)
        caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                  for _ in range(args.layers)]
        times: dict[str, list[float]] = {"baseline": [], "ours": []}
        for _ in range(args.repeats):
            for name, kernels in (("baseline", baseline), ("ours", ours)):
                t0 = time.perf_counter()
                for k, v in caches:
                    kernels.paged_decode_attention(q, k, v, tables, lens, args.head_dim ** -0.5)
                times[name].append(time.perf_counter() - t0)
        old, new = (statistics.median(times[n]) * 1e3 for n in ("baseline", "ours"))
        print(f"| {str(dtype).removeprefix('torch.')} | {old:.1f} | {new:.1f} | {old / new:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
