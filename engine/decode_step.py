"""A decode-only step of an fp32 CPU model in one native call (engine/kernels/decode_layers.cpp).

Most steps of a busy engine are decodes only: one new token per running sequence. For those, on CPU with the
native kernels and every linear layer oneDNN-packed, the runner calls `NativeDecodeStep` instead of the
model's Python forward. It makes the same calls in the same order in C++ (the result is bit for bit the
same), without the interpreter around them: about 25 Python-level calls per layer, 750 a step for SmolLM2
(`python -m bench.engine_ablations` measures the difference). Steps with a prompt chunk, other dtypes, the
int8 tier and CUDA keep the Python forward.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.onednn_linear import OneDnnLinear


class NativeDecodeStep:
    def __init__(self, model: Any, kernels: Any) -> None:
        cfg = model.config
        self.model, self.kernels = model, kernels
        self.eps, self.heads, self.kv_heads, self.dim = cfg.rms_norm_eps, cfg.num_attention_heads, \
            cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.dim ** -0.5
        none = torch.empty(0)

        def bias(linear: OneDnnLinear) -> torch.Tensor:
            return none if linear.bias is None else linear.bias

        self.weights: list[torch.Tensor] = []
        for layer in model.layers:  # the order decode_layers.cpp reads them in
            attn, mlp = layer.self_attn, layer.mlp
            self.weights += [layer.input_layernorm.weight, attn.qkv_proj.packed, bias(attn.qkv_proj),
                             attn.o_proj.packed, layer.post_attention_layernorm.weight, mlp.gate_up_proj.packed,
                             bias(mlp.gate_up_proj), mlp.down_proj.packed, bias(mlp.down_proj)]

    @classmethod
    def of(cls, model: Any, kernels: Any | None) -> NativeDecodeStep | None:
        """The native step for this model, or None where it does not apply (no kernels, not fp32 on CPU, a
        layer that is not oneDNN-packed, as in the int8 tier)."""
        if kernels is None or model.embed_tokens.weight.dtype != torch.float32 \
                or model.embed_tokens.weight.device.type != "cpu":
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m, OneDnnLinear) for m in linears):
            return None
        return cls(model, kernels)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [N, hidden] (as the model's forward returns them) for N decodes."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        return self.kernels.decode_layers(x, self.weights, cos, sin, kv_caches, meta.slot_mapping,
                                          meta.decode_block_tables, meta.decode_context_lens, self.eps, self.heads,
                                          self.kv_heads, self.dim, self.scale)
