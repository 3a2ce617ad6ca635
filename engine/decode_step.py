"""A decode-only step of a CPU model in one native call (engine/kernels/decode_layers.cpp).

Most steps of a busy engine are decodes only: one new token per running sequence. For those, on CPU with the
native kernels, the runner calls `NativeDecodeStep` instead of the model's Python forward when every linear
layer is one the native code can call: oneDNN-packed (engine/onednn_linear.py; fp32 weights, or the bf16 ones
of the runner's bf16 on CPU, whose activations are fp32) or the int8 tier's (engine/int8_dynamic.py). It makes
the same calls in the same order in C++, so the result is bit for bit the same, without the interpreter around
them: about 25 Python-level calls per layer, 750 a step for SmolLM2 (`python -m bench.engine_ablations` measures
the difference). With bf16 weights the rounding of each matmul's input to bf16 and the widening of its result are
made inside the layer steps around it rather than by torch calls of their own (the same bits; BENCHMARKS.md,
session 50). Steps with a prompt chunk, models whose activations are not fp32, other linear layers and CUDA
keep the Python forward. The head (compute_logits) stays in Python: one call a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.int8_dynamic import Int8DynamicLinear
from engine.onednn_linear import OneDnnLinear


def _supported(linear: nn.Module) -> bool:
    """oneDNN-packed fp32, or an int8 layer with its fused per-token steps (the tier's, not a weaker scheme)."""
    return isinstance(linear, OneDnnLinear) or (isinstance(linear, Int8DynamicLinear) and linear.kernels is not None)


class NativeDecodeStep:
    def __init__(self, model: Any, kernels: Any) -> None:
        cfg = model.config
        self.model = model
        self.layers = kernels.DecodeLayers(eps=cfg.rms_norm_eps, heads=cfg.num_attention_heads,
                                           kv_heads=cfg.num_key_value_heads, dim=cfg.head_dim,
                                           scale=cfg.head_dim ** -0.5)
        for layer in model.layers:  # the order decode_layers.cpp reads them in
            self.layers.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            for m in layer.linears():
                if isinstance(m, OneDnnLinear):
                    self.layers.add_onednn_linear(m.packed, m.bias, m.weight_dtype is not None)
                else:
                    self.layers.add_int8_linear(m.packed, m.reduce_range, m.outliers, m.w_outliers, m.w_rowsum, m.bias)

    @classmethod
    def of(cls, model: Any, kernels: Any | None) -> NativeDecodeStep | None:
        """The native step for this model, or None where it does not apply (no kernels, activations not fp32 on
        CPU, a linear layer the native code does not run)."""
        weight = model.embed_tokens.weight
        if kernels is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        supported = all(_supported(m) for layer in model.layers for m in layer.linears())
        return cls(model, kernels) if supported else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [N, hidden] (as the model's forward returns them) for N decodes."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        return self.layers.run(x, cos, sin, kv_caches, meta.slot_mapping, meta.decode_block_tables,
                               meta.decode_context_lens)
