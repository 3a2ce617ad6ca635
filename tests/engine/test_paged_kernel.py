"""The native decode-attention kernel against the torch path it replaces (gather + SDPA), and its fallback."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention
from engine.kernels import native as kernel_loader

KERNEL = kernel_loader.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain: the torch path is tested everywhere else")


def decode_meta(tables: torch.Tensor, lens: list[int], kernel: object | None) -> AttentionMetadata:
    ctx = max(lens)
    mask = (torch.arange(ctx)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decode_seqs=len(lens), decode_block_tables=tables,
        decode_mask=mask, decode_context_len=ctx, decode_context_lens=torch.tensor(lens), prefill_query_starts=[],
        prefill_query_lens=[], prefill_block_tables=[], prefill_context_lens=[], decode_kernel=kernel)


@pytest.mark.parametrize(("dtype", "cache_dtype", "tol"), [(torch.float32, torch.float32, 1e-5),
                                                           (torch.bfloat16, torch.bfloat16, 2e-2),
                                                           (torch.float32, torch.bfloat16, 1e-5)])  # bf16 KV cache
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])  # 3, 1 and 8 query heads per K/V head
@pytest.mark.parametrize("dim", [64, 128, 16])  # multiples of 32 take the AVX2 path where the CPU has it
def test_kernel_matches_gather_and_sdpa(dtype: torch.dtype, cache_dtype: torch.dtype, tol: float, heads: int,
                                        kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + dim)
    block_size, num_blocks = 16, 128
    lens = [1, 15, 16, 17, 100, 257]  # inside a block, on a boundary, just past it, several blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    want = paged_attention(q, k_cache, v_cache, decode_meta(tables, lens, None), dim ** -0.5)
    got = paged_attention(q, k_cache, v_cache, decode_meta(tables, lens, KERNEL), dim ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [64, 16])  # the AVX2 kernels where the CPU has them, and the plain loops
def test_the_bf16_result_is_the_fp32_one_rounded_as_torch_rounds(dim: int) -> None:
    """For the native step of bf16 weights (the o projection's input): fp32 queries over a bf16 cache."""
    gen = torch.Generator().manual_seed(dim)
    block_size, num_blocks, lens = 16, 80, [1, 17, 100, 300]
    k_cache = torch.randn(num_blocks, block_size, 3, dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, 3, dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * 19].view(len(lens), 19)
    q, ctx = torch.randn(len(lens), 9, dim, generator=gen), torch.tensor(lens)
    want = KERNEL.paged_decode_attention(q, k_cache, v_cache, tables, ctx, dim ** -0.5).to(torch.bfloat16)
    got = KERNEL.paged_decode_attention_bf16(q, k_cache, v_cache, tables, ctx, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(RuntimeError, match="bf16 cache only"):
        KERNEL.paged_decode_attention_bf16(q, k_cache.float(), v_cache.float(), tables, ctx, dim ** -0.5)


def test_kernel_refuses_a_context_longer_than_its_table() -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="context length out of range"):
        KERNEL.paged_decode_attention(torch.zeros(1, 1, 8), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                                      torch.tensor([33]), 1.0)


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERGATE_NATIVE_KERNELS=0 selects the torch path (the one every CUDA run takes)."""
    kernel_loader.load.cache_clear()
    monkeypatch.setenv("TIERGATE_NATIVE_KERNELS", "0")
    assert kernel_loader.load() is None
    kernel_loader.load.cache_clear()
    monkeypatch.setenv("TIERGATE_NATIVE_KERNELS", "1")
    assert kernel_loader.load() is KERNEL
