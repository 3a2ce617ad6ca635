"""The steps of a Llama layer between its matmuls: RMSNorm (with the residual add before it), rope with the
K/V cache write, and SiLU(gate) * up.

`TorchLayerOps` is the reference: torch ops with transformers' Llama numerics (fp32 RMSNorm, rotate-half
rope), used on CUDA, for dtypes other than fp32, and wherever the native kernels cannot be built.
`NativeLayerOps` runs the same steps fused in C++ (engine/kernels/layer_ops.cpp), one pass over the rows
each, for fp32 CPU tensors, and falls back to the reference for anything else. At a decode step's few rows
this removes most of the ~40 small torch ops a layer otherwise dispatches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class TorchLayerOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()  # in fp32 whatever the model's dtype, as transformers does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + delta) * weight, residual + delta)."""
        residual = residual + delta
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
        """qkv [N, (H + 2 KV) * D]; cos, sin [N, D]. Writes rotated K and V to their slots; returns q [N, H, D]."""
        n = qkv.shape[0]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = apply_rotary(q.view(n, heads, dim), cos, sin)
        k = apply_rotary(k.view(n, kv_heads, dim), cos, sin)
        k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))  # the cache may be narrower
        v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v.reshape(n, kv_heads, dim).to(v_cache.dtype))
        return q

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, D]; cos, sin: [N, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the native rope step writes


class NativeLayerOps(TorchLayerOps):
    """The fused C++ steps for contiguous fp32 CPU tensors; the torch reference for anything else."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    @staticmethod
    def _native(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
        return all(t.dtype in dtypes and t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._native(x, weight) and x.dim() == 2:
            return self.kernels.rms_norm(x, weight, eps)
        return TorchLayerOps.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds delta into `residual` in place (the layers' own running sum)."""
        if self._native(residual, delta, weight) and residual.dim() == 2:
            out, residual = self.kernels.add_rms_norm(residual, delta, weight, eps)
            return out, residual
        return TorchLayerOps.add_rms_norm(residual, delta, weight, eps)

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
        # the cache may be bf16 under an fp32 model
        caches = k_cache.dtype == v_cache.dtype and self._native(k_cache, v_cache, dtypes=CACHE_DTYPES)
        if self._native(qkv, cos, sin) and caches:
            return self.kernels.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim)
        return TorchLayerOps.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._native(gate_up) and gate_up.dim() == 2:
            return self.kernels.silu_mul(gate_up)
        return TorchLayerOps.silu_mul(gate_up)
