"""Does a row's result from oneDNN depend on the rows beside it, and what does running one row as two cost?

    .venv/bin/python -m bench.onednn_rows [--repeat 2000]

For SmolLM2's linear shapes, fp32 weights and (where oneDNN runs them) bf16 ones, on one thread pinned to the last
CPU: which row counts give other bits than the same rows computed 1,024 at a time, calling oneDNN directly (the
engine's single-row rule off); and the time of one row as oneDNN takes it against one row run as two (what
engine/onednn_linear.py and the native decode step do), best of three rounds of --repeat calls, per shape and summed
over a layer's four linears. oneDNN runs as the engine runs it: on AMX where the CPU has it, and capped below AMX
with `TIERGATE_ONEDNN_AMX=0` (engine/onednn_linear.py; on an Intel Xeon with AMX, session 17: with AMX, bf16 rows 33
to a few hundred round otherwise than fewer or more; capped, no count differs). Run it on a CPU not measured yet
(AVX2 only) before asserting more there (tests/engine/test_onednn_linear.py).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.ledger_stores import cpu_model
from engine import onednn_linear
from engine.onednn_linear import OneDnnLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: a layer's four
ROW_COUNTS = (1, 2, 3, 5, 16, 17, 32, 33, 64, 100, 256, 257, 512, 513, 600, 700)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    torch.set_num_threads(1)
    op = torch.ops.mkldnn._linear_pointwise
    dtypes = [None] + ([torch.bfloat16] if onednn_linear.available(torch.device("cpu"), torch.bfloat16) else [])
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; one thread\n")
    print("| weights | out x in | row counts whose bits differ from 1,024 at a time | one row, µs "
          "| one row as two, µs |")
    print("|---|---|---|---|---|")
    for dtype in dtypes:
        totals = [0.0, 0.0]
        for out_features, in_features in SHAPES:
            torch.manual_seed(in_features)
            lin = OneDnnLinear(torch.randn(out_features, in_features) * 0.05, None, dtype)

            def raw(x: torch.Tensor, lin: OneDnnLinear = lin, dtype: torch.dtype | None = dtype) -> torch.Tensor:
                return op(x.to(dtype) if dtype else x, lin.packed, None, "none", [], "")

            x = torch.randn(1024, in_features)
            whole = raw(x)
            differ = []  # whole groups only: a last group of another size would be measured as that size
            for rows in ROW_COUNTS:
                n = 1024 // rows * rows
                if not torch.equal(torch.cat([raw(x[i:i + rows]) for i in range(0, n, rows)]), whole[:n]):
                    differ.append(rows)
            one, two = x[:1], torch.cat([x[:1], x[:1]])
            best = {"one": float("inf"), "two": float("inf")}
            for _ in range(3):
                for name, rows in (("one", one), ("two", two)):
                    t0 = time.perf_counter()
                    for _ in range(args.repeat):
                        raw(rows)
                    best[name] = min(best[name], (time.perf_counter() - t0) / args.repeat)
            totals[0] += best["one"]
            totals[1] += best["two"]
            print(f"| {'bf16' if dtype else 'fp32'} | {out_features} x {in_features} | {differ or 'none'} | "
                  f"{best['one'] * 1e6:.1f} | {best['two'] * 1e6:.1f} |")
        print(f"| {'bf16' if dtype else 'fp32'} | a layer's four | | {totals[0] * 1e6:.1f} | {totals[1] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
