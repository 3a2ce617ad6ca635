"""The fused C++ layer steps against their torch reference (transformers' numerics), one by one and through
a whole model; the greedy equality tests run SmolLM2 and a tiny Llama through them against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import native
from engine.layer_ops import NativeLayerOps, TorchLayerOps
from engine.model_runner import ModelRunner

KERNELS = native.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain: the torch reference is used everywhere")
TORCH = TorchLayerOps()
FUSED = NativeLayerOps(KERNELS)
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("rows", [1, 16, 700])  # 700 rows are split over threads
def test_rms_norm_and_residual_add(rows: int) -> None:
    torch.manual_seed(rows)
    x, delta, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.rand(576) + 0.5
    torch.testing.assert_close(FUSED.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5), **TOL)
    want_out, want_sum = TORCH.add_rms_norm(x, delta, weight, 1e-5)
    residual = x.clone()
    got_out, got_sum = FUSED.add_rms_norm(residual, delta, weight, 1e-5)
    torch.testing.assert_close(got_out, want_out, **TOL)
    torch.testing.assert_close(got_sum, want_sum, **TOL)
    assert got_sum.data_ptr() == residual.data_ptr()  # the running sum is updated in place, no copy


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_writes_rotated_k_and_v_to_their_slots(rows: int, cache_dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, dim, blocks, block_size = 9, 3, 64, 40, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(rows, dim // 2) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.randperm(blocks * block_size)[:rows]
    # k, v for torch; k, v for fused
    caches = [torch.randn(blocks, block_size, kv_heads, dim).to(cache_dtype) for _ in range(4)]
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    want = TORCH.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads, dim)
    got = FUSED.rope_write_kv(qkv, cos, sin, caches[2], caches[3], slots, heads, kv_heads, dim)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(caches[2], caches[0], **TOL)  # written slots equal, every other slot untouched
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # V is copied as is


def test_rope_refuses_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        FUSED.rope_write_kv(torch.zeros(1, 3 * 8), torch.ones(1, 8), torch.zeros(1, 8), cache, cache.clone(),
                            torch.tensor([8]), 1, 1, 8)


@pytest.mark.parametrize("rows", [1, 64, 200])
def test_silu_times_up(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1536) * 4
    torch.testing.assert_close(FUSED.silu_mul(gate_up), TORCH.silu_mul(gate_up), **TOL)


def test_other_dtypes_take_the_torch_reference() -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    torch.testing.assert_close(FUSED.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))
    assert FUSED.silu_mul(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_model_gives_the_same_logits_with_either(tiny_llama: Path) -> None:
    from engine.int8_dynamic import prefill_logits

    runner = ModelRunner(tiny_llama, dtype="fp32")
    assert isinstance(runner.model.ops, NativeLayerOps)
    ids = torch.randint(0, 256, (50,))
    fused = prefill_logits(runner.model, ids)
    runner.model.ops = TorchLayerOps()
    torch.testing.assert_close(fused, prefill_logits(runner.model, ids), rtol=1e-4, atol=1e-4)


def test_without_native_kernels_the_runner_uses_torch_ops(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        runner = ModelRunner(tiny_llama, dtype="fp32")
        assert type(runner.model.ops) is TorchLayerOps and runner.decode_kernel is None
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
        assert native.load() is not None
