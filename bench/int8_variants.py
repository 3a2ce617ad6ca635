"""How each step of the int8 tier's CPU scheme (engine/int8_dynamic.py) moves its agreement with fp32.

`.venv/bin/python -m bench.int8_variants` (see --help). Teacher-forced top-1 agreement with our fp32
model on held-out ShareGPT text (the same tail as bench/engine.py), for a chain of schemes, each adding
one step to the one before, up to what the `mid` tier runs; then one alternative that was turned down.
All on fbgemm's u8 x s8 kernels.
"""

from __future__ import annotations

import argparse
import os
from typing import Any
from unittest import mock

from assets import offline_hub

offline_hub()

# (label, per-token scales, weight qmax, head in fp16, SmoothQuant, outlier channels)
CHAIN = [
    ("torch's defaults: one scale per tensor, 7-bit activations, int8 head", False, 127, False, False, False),
    ("+ per-token scales", True, 127, False, False, False),
    ("+ fp16 head", True, 127, True, False, False),
    ("+ 8-bit activations, 7-bit weights", True, 63, True, False, False),
    ("+ SmoothQuant (alpha 0.5)", True, 63, True, True, False),
    ("+ 32 / 64 outlier channels in fp32 (the mid tier)", True, 63, True, True, True),
    ("the mid tier, but an int8 head (with 32 outlier channels) instead of fp16", True, 63, False, True, True),
]


def build(per_token: bool, qmax: int, fp16_head: bool, smooth: bool, outliers: bool) -> Any:
    import torch
    from torch import nn

    from bench.engine import MODEL_DIR
    from engine import int8_dynamic as q
    from engine.model_runner import ModelRunner

    # plain nn.Linear layers to swap (the runner packs fp32 ones for oneDNN)
    with mock.patch.dict(os.environ, {"TIERGATE_ONEDNN": "0"}):
        model = ModelRunner(MODEL_DIR, dtype="fp32", kv_cache_bytes=1 << 24).model
    ranges = q.activation_ranges(model, q.calibration_chunks(MODEL_DIR))
    if smooth:
        q.smooth_(model, ranges)
    none = torch.zeros(0, dtype=torch.long)

    def swap(lin: nn.Linear, key: str, k: int) -> nn.Module:
        idx = torch.topk(ranges[key], k).indices.sort().values if outliers else none
        return q.Int8DynamicLinear(lin.weight, lin.bias, idx, per_token=per_token, weight_qmax=qmax)

    with torch.inference_mode():
        model.lm_head = q.Fp16Linear(model.lm_head) if fp16_head else swap(model.lm_head, "lm_head", 32)
        for i, layer in enumerate(model.layers):
            for parent, prefix in ((layer.self_attn, "self_attn."), (layer.mlp, "mlp.")):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        k = q.OUTLIERS.get(name, q.DEFAULT_OUTLIERS)
                        setattr(parent, name, swap(child, f"layers.{i}.{prefix}{name}", k))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens to compare on")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.engine import MODEL_DIR, held_out_chunks, top1
    from engine.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    chunks = held_out_chunks(AutoTokenizer.from_pretrained(MODEL_DIR), args.tokens)
    ref = top1(ModelRunner(MODEL_DIR, dtype="fp32", kv_cache_bytes=1 << 24).model, chunks)
    print("\n| scheme | tokens | top-1 agreement with fp32 |\n|---|---|---|", flush=True)
    for label, *spec in CHAIN:
        agree = float((top1(build(*spec), chunks) == ref).float().mean())
        print(f"| {label} | {len(ref)} | {agree:.1%} |", flush=True)


if __name__ == "__main__":
    main()
