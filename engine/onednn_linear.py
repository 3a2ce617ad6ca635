"""Linear layers on oneDNN's prepacked weights: the engine's CPU matmuls for fp32 and bf16.

torch's `nn.Linear` on CPU calls MKL's sgemm on the weight as stored. At the few rows a decode step has,
oneDNN with the weight reordered once, at load, into its blocked layout is faster (the same kernel torch's
inductor uses after freezing): SmolLM2's linear layers alone run 1.5-2x nn.Linear's speed at 4-64 rows
(`python -m bench.engine` measures both ceilings), and a 16-stream decode step takes half the time
(`python -m bench.engine_ablations`). Results are the same fp32 sums in another order (differences near 1e-6
relative).

With `weight_dtype=bf16` under an fp32 model (the runner's bf16 on CPU), the weight is packed in bf16 and each
call rounds its input to bf16 and widens the bf16 result back to fp32: the matmul reads half the bytes and runs on
AVX-512 BF16 / AMX, while norms, rope, attention and the residual stream stay fp32 (see ModelRunner).

One row is run as two (the row twice, the first result kept): oneDNN takes another kernel for a single row, and
for SmolLM2's down projection (1,536 inputs) its sums differed in the last bit from the same row's computed among
others, for fp32 and bf16 weights alike, so a greedy answer could change with what it was batched with (8 of 16
ShareGPT answers of `full` in bf16, 64 tokens, alone against together, on an AMD Zen 4). There every row count from
2 up gives the same bits (tests/engine/test_onednn_linear.py, asserted on AVX-512 without AMX, where it was
measured); the second row costs a few percent of a layer's linears at one row (`python -m bench.onednn_rows`).

On CPUs with AMX, oneDNN runs bf16 matmuls of 33 to a few hundred rows on AMX tiles and fewer or more rows on
AVX-512 BF16, and the two round differently (a few rows in a hundred, in the last bit; `python -m
bench.onednn_rows`): there a sequence's bf16 answer can change when its step holds more than 32 rows.
TIERGATE_ONEDNN_AMX=0 caps oneDNN at AVX-512 BF16 (`ONEDNN_MAX_CPU_ISA`, set before the process's first oneDNN call,
which reads it), where every row count from 2 up gives the same bits. It is not the default: measured on an Intel
Xeon (session 17), the capped kernels answered SmolLM2's "What is the capital of France?" with a near tie's other
first token (top-1 agreement with fp32 97.4% against AMX's 97.7% on 4,096 tokens) and prompts lose AMX's speed.
fp32 runs no AMX kernel, so only bf16 weights see the switch.

Used for inference only (the runner packs its model once; training keeps nn.Linear). The packed weight
is an opaque oneDNN tensor, so a packed model is not saved. TIERGATE_ONEDNN=0 keeps nn.Linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; any row count runs on it
ISA_CAP = "AVX512_CORE_BF16"  # the highest oneDNN ISA below AMX, under TIERGATE_ONEDNN_AMX=0 (the docstring)


def cap_isa_below_amx() -> None:
    """Keep oneDNN off AMX in this process when TIERGATE_ONEDNN_AMX=0 (unless ONEDNN_MAX_CPU_ISA is set already).
    oneDNN reads the variable once, at its first use (a primitive, or asking whether it runs bf16): called once, when
    this module is imported, which the engine's runner does before any model code."""
    if os.environ.get("TIERGATE_ONEDNN_AMX", "1") == "0":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ISA_CAP)


cap_isa_below_amx()  # on import: even asking oneDNN whether it runs bf16 (`available`) fixes its ISA


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN serves CPU fp32 linears, and bf16 ones on CPUs with AVX-512; TIERGATE_ONEDNN=0 turns it off."""
    if os.environ.get("TIERGATE_ONEDNN", "1") == "0" or device.type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnLinear(nn.Module):
    """y = x W^T + b on a weight reordered once into oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """weight: [out, in] as nn.Linear holds it. `weight_dtype` (bf16 under an fp32 weight): pack the weight in
        that dtype; inputs are rounded to it and results widened back to the input's dtype."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.weight_dtype = weight_dtype if weight_dtype not in (None, weight.dtype) else None
        if self.weight_dtype is not None:
            weight = weight.to(self.weight_dtype)
            bias = None if bias is None else bias.to(self.weight_dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, linear: nn.Linear, weight_dtype: torch.dtype | None = None) -> OneDnnLinear:
        return cls(linear.weight, linear.bias, weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, self.in_features)
        single = x.shape[0] == 1
        if single:  # one row runs as two (see the module's docstring)
            x = torch.cat([x, x])
        if self.weight_dtype is not None:
            x = x.to(self.weight_dtype)  # decode_layers.cpp makes the same two inside its layer steps
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if single:
            y = y[:1]
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


def pack_linears_(model: nn.Module, weight_dtype: torch.dtype | None = None) -> int:
    """Replace every nn.Linear in `model` (in place) by its oneDNN-packed twin (weights in `weight_dtype`, default
    their own); returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, OneDnnLinear.of(child, weight_dtype))
    return len(targets)
