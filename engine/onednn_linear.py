"""Linear layers on oneDNN's prepacked weights: the engine's CPU matmuls for fp32 and bf16.

torch's `nn.Linear` on CPU calls MKL's sgemm on the weight as stored. At the few rows a decode step has,
oneDNN with the weight reordered once, at load, into its blocked layout is faster (the same kernel torch's
inductor uses after freezing): SmolLM2's linear layers alone run 1.5-2x nn.Linear's speed at 4-64 rows
(`python -m bench.engine` measures both ceilings), and a 16-stream decode step takes half the time
(`python -m bench.engine_ablations`). Results are the same fp32 sums in another order (differences near 1e-6
relative).

Used for inference only (the runner packs its model once; training keeps nn.Linear). The packed weight
is an opaque oneDNN tensor, so a packed model is not saved. TIERGATE_ONEDNN=0 keeps nn.Linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; any row count runs on it


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN serves CPU fp32 linears, and bf16 ones on CPUs with AVX-512; TIERGATE_ONEDNN=0 turns it off."""
    if os.environ.get("TIERGATE_ONEDNN", "1") == "0" or device.type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnLinear(nn.Module):
    """y = x W^T + b on a weight reordered once into oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight: [out, in] as nn.Linear holds it."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, linear: nn.Linear) -> OneDnnLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(), self.packed,
                                               self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


def pack_linears_(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (in place) by its oneDNN-packed twin; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, OneDnnLinear.of(child))
    return len(targets)
