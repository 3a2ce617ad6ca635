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


BF16 = torch.bfloat16


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.view(torch.int16 if got.dtype == BF16 else torch.int32),
                                                   want.view(torch.int16 if want.dtype == BF16 else torch.int32))


@pytest.mark.parametrize("rows", [1, 16, 700])  # 700 rows are split over threads
def test_the_bf16_steps_are_the_fp32_ones_rounded_as_torch_rounds(rows: int) -> None:
    """The native decode step of bf16 weights makes each matmul's bf16 input in the step before it and takes its bf16
    result as it comes: the same bits as the fp32 step's result converted by torch, as the Python layers do."""
    torch.manual_seed(rows)
    x, delta, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.rand(576) + 0.5
    x[0, 3] = float("nan")  # a NaN row: torch rounds every NaN to 0xffff
    assert same_bits(KERNELS.rms_norm_bf16(x, weight, 1e-5), KERNELS.rms_norm(x, weight, 1e-5).to(BF16))
    for d in (delta, delta.to(BF16)):  # the residual add takes a bf16 matmul's result as it is
        want_sum, got_sum = x.clone(), x.clone()
        want, _ = KERNELS.add_rms_norm(want_sum, d.float(), weight, 1e-5)
        got, summed = KERNELS.add_rms_norm_bf16(got_sum, d, weight, 1e-5)
        assert same_bits(got, want.to(BF16)) and same_bits(got_sum, want_sum)
        assert summed.data_ptr() == got_sum.data_ptr()
    gate_up = torch.randn(rows, 2 * 1536) * 4
    for g in (gate_up, gate_up.to(BF16)):
        assert same_bits(KERNELS.silu_mul_bf16(g), KERNELS.silu_mul(g.float()).to(BF16))


def test_rounding_to_bf16_is_torchs_on_ties_and_near_the_top() -> None:
    """silu(g) * 1 is g itself for large g where the kernel divides exactly (AVX2, Zen 4): the rounding alone, on
    chosen bit patterns. Under the kernels' -ffast-math the vector loop may divide by a refined reciprocal instead:
    on an AMX Xeon every element of the fp32 silu_mul came out one ulp under g. The bf16 kernel is held to torch's
    rounding of the fp32 kernel's own result, then, within a ulp of the chosen bits."""
    low = [0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # the bits rounded away: down, a tie, up
    bits = [(top << 16) | b for top in (0x4200, 0x4201, 0x7F7F, 0x5F3A) for b in low]  # even and odd tops; FLT_MAX
    gate = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    fp32 = KERNELS.silu_mul(gate_up)
    assert int((fp32.view(torch.int32) - gate[None].view(torch.int32)).abs().max()) <= 1
    assert same_bits(KERNELS.silu_mul_bf16(gate_up), fp32.to(BF16))
    assert torch.isinf(KERNELS.silu_mul_bf16(gate_up)).any()  # FLT_MAX's neighbours round up to inf, as torch's do


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_takes_a_bf16_qkv_as_its_fp32_widening(cache_dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    heads, kv_heads, dim, rows = 9, 3, 64, 20
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(BF16)
    angles = torch.rand(rows, dim // 2) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.randperm(40 * 16)[:rows]
    caches = [torch.zeros(40, 16, kv_heads, dim, dtype=cache_dtype) for _ in range(4)]
    want = KERNELS.rope_write_kv(qkv.float(), cos, sin, caches[0], caches[1], slots, heads, kv_heads, dim)
    got = KERNELS.rope_write_kv(qkv, cos, sin, caches[2], caches[3], slots, heads, kv_heads, dim)
    assert same_bits(got, want) and same_bits(caches[2], caches[0]) and same_bits(caches[3], caches[1])


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
