"""What the int8 tier's row-invariant outlier matmul costs on the torch ops (engine/int8_dynamic.py), side by side.

`TIERGATE_NATIVE_KERNELS=0 .venv/bin/python -m bench.int8_rows` (see --help). On SmolLM2-135M's `mid` tier
without the native kernels: the 120 Int8DynamicLinear layers (30 decoder layers x qkv, o, gate_up, down) run one
after another on real activations of N rows, N = 1 (a decode) and 64 (a prompt chunk), with the outlier side
matmul as shipped (its rows padded to whole 6-row fbgemm kernels) and as before (one unpadded fbgemm call, whose
1- and 2-row kernels round otherwise). Best of --repeats runs each, interleaved; the gap is the padding's cost.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from unittest import mock

from assets import offline_hub

offline_hub()


def unpadded(kept: object, packed: object) -> object:
    """The side matmul before: one fbgemm call over the rows as they come."""
    import torch

    return torch.ops.quantized.linear_dynamic_fp16(torch.cat((kept, kept), dim=1), packed)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from bench.engine import MODEL_DIR
    from engine import int8_dynamic
    from engine.kernels import native
    from engine.model_runner import ModelRunner

    with mock.patch.object(native, "load", lambda: None):
        runner = ModelRunner(MODEL_DIR, dtype="fp32", quantize="int8", kv_cache_bytes=8 << 20)
    layers = [m for m in runner.model.modules() if isinstance(m, int8_dynamic.Int8DynamicLinear)]
    inputs: dict[int, torch.Tensor] = {}

    def record(mod: torch.nn.Module, args_: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        inputs[id(mod)] = args_[0].detach().reshape(-1, mod.in_features).clone()

    hooks = [m.register_forward_hook(record) for m in layers]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, runner.config.vocab_size, (max(args.rows),), generator=g)
    int8_dynamic.prefill_logits(runner.model, ids)
    for h in hooks:
        h.remove()
    print(f"{len(layers)} int8 layers, torch ops, {torch.get_num_threads()} threads; best of {args.repeats}")

    @torch.inference_mode()
    def run_all(n: int) -> None:
        for m in layers:
            m(inputs[id(m)][:n])

    for n in args.rows:
        times = {"padded (now)": float("inf"), "unpadded (before)": float("inf")}
        for _ in range(args.repeats):
            times["padded (now)"] = min(times["padded (now)"], seconds(lambda n=n: run_all(n)))
            with mock.patch.object(int8_dynamic, "_fp16_matmul_in_whole_kernels", unpadded):
                times["unpadded (before)"] = min(times["unpadded (before)"], seconds(lambda n=n: run_all(n)))
        now, before = times["padded (now)"], times["unpadded (before)"]
        print(f"{n:4d} rows: padded {now * 1e3:7.2f} ms, unpadded {before * 1e3:7.2f} ms "
              f"({(now / before - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
