"""Attention over the paged KV cache, for a step that mixes prompt chunks and decodes.

The cache holds K/V in the model's dtype, or in bf16 under an fp32 model (half the bytes each decode reads);
attention itself computes in the model's dtype either way.

The runner orders a step's tokens with single-token sequences (decodes) first, then prompt chunks (on CPU it hands
every prompt row over as a decode of its own). The
decodes are attended on CPU by the native kernel that reads their blocks in place (engine/kernels), in one call;
otherwise by SDPA: on CUDA in one call over their gathered, padded contexts, on CPU one by one over each
context alone (a decode's sums then do not depend on what is batched beside it, as in the kernel); each prompt chunk is
attended on its own (its causal mask is offset by the tokens already cached). K/V of every new token are
written to their slots first (by the layer's rope step, engine/layer_ops.py), so a chunk sees its own tokens
and its cached prefix the same way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the paged cache; built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [N] cache slot (block_id * block_size + offset) of each new token
    # the first this-many tokens are attended as decodes, each over its own context: one-token sequences, and on CPU
    # every prompt row too (engine/model_runner.py: a row's sums then do not depend on how its prompt was cut)
    num_decode_seqs: int
    decode_block_tables: torch.Tensor  # [B, max_blocks] block ids of the decodes, padded with 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True where a slot is in the context
    decode_context_len: int  # the longest decode context; slots past it are cut before attention
    decode_context_lens: torch.Tensor  # [B] int64: each decode's context, its new token included
    prefill_query_starts: list[int]  # per prompt chunk: index of its first token in the step
    prefill_query_lens: list[int]  # per prompt chunk: its number of new tokens
    prefill_block_tables: list[torch.Tensor]  # per prompt chunk: [num_blocks] its block ids
    prefill_context_lens: list[int]  # per prompt chunk: cached + new tokens
    decode_kernel: Any | None = None  # engine.kernels' compiled module: decodes read the cache in place


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, H, D] for the step's new tokens (their K/V already written); returns [N, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    rep = num_heads // num_kv_heads
    b = meta.num_decode_seqs
    if b == q.shape[0] and meta.decode_kernel is not None:  # a step of decodes only
        return meta.decode_kernel.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                         meta.decode_context_lens, scale)
    out = torch.empty_like(q)
    if b and meta.decode_kernel is not None:
        out[:b] = meta.decode_kernel.paged_decode_attention(q[:b], k_cache, v_cache, meta.decode_block_tables,
                                                            meta.decode_context_lens, scale)
    elif b and q.device.type == "cpu":
        out[:b] = _decodes_one_by_one(q[:b], k_cache, v_cache, meta, scale)
    elif b:
        # gather each decode's context: [B * max_blocks, block_size, KV, D] -> [B, KV, ctx, D]
        ctx = meta.decode_context_len
        blocks = meta.decode_block_tables.flatten()  # index_select: about 1.7x faster than fancy indexing on CPU
        k = k_cache.index_select(0, blocks).view(b, -1, num_kv_heads, head_dim)[:, :ctx].transpose(1, 2).to(q.dtype)
        v = v_cache.index_select(0, blocks).view(b, -1, num_kv_heads, head_dim)[:, :ctx].transpose(1, 2).to(q.dtype)
        qd = q[:b].view(b, num_kv_heads, rep, head_dim)  # [B, KV, rep, D]: the heads sharing one K/V
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:b] = o.reshape(b, num_heads, head_dim)
    for start, qlen, table, ctx in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                       meta.prefill_block_tables, meta.prefill_context_lens, strict=True):
        # k: [ctx, KV, D] -> [H, ctx, D], each K/V head repeated for the query heads that share it
        k = k_cache.index_select(0, table).flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(rep, dim=0).to(q.dtype)
        v = v_cache.index_select(0, table).flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(rep, dim=0).to(q.dtype)
        # [1, H, T, D]: with a batch dimension SDPA takes its fused (flash) CPU kernel; given [H, T, D] it took the
        # unfused math path, ~4x slower at 512 tokens (13.9 against 3.6 ms a layer, fp32, 2 threads)
        qp = q[start:start + qlen].transpose(0, 1)[None]
        k, v = k[None], v[None]
        if ctx == qlen:
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale)
        else:  # a later chunk: query i sits at position ctx - qlen + i and sees everything up to it
            pos_q = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]  # [T, ctx]
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
        out[start:start + qlen] = o[0].transpose(0, 1)
    return out


def _decodes_one_by_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """The decodes [B, H, D] on CPU without the native kernel, each over its own context alone, as that kernel reads
    them: SDPA's CPU kernel blocks the context by its length, so a decode padded to a batch's longest context (and
    masked) summed its scores otherwise than alone, an ulp or two apart with whatever was batched beside it.

    The rows of one prompt chunk (consecutive, one block table, contexts one apart) share one gather of K/V, each
    row attending a view of its first tokens: a view laid out as its own gather was (the same strides), so SDPA
    sums it alike, and a chunk of T rows copies its context once rather than T times."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lens = meta.decode_context_lens
    tables = meta.decode_block_tables
    # a row continues the previous row's group when it reads the same blocks one token further
    same = (tables[1:] == tables[:-1]).all(1) & (lens[1:] == lens[:-1] + 1)
    starts = [0, *(torch.nonzero(~same).flatten() + 1).tolist(), q.shape[0]]
    ctxs = lens.tolist()
    qd = q.view(q.shape[0], 1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, 1, KV, rep, D]
    out = torch.empty_like(q)
    for first, end in itertools.pairwise(starts):
        blocks = tables[first, :-(-ctxs[end - 1] // block_size)]
        # [1, KV, blocks * bs, D]
        k = k_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None].to(q.dtype)
        v = v_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None].to(q.dtype)
        rows = [F.scaled_dot_product_attention(qd[i], k[:, :, :ctxs[i]], v[:, :, :ctxs[i]], scale=scale)
                for i in range(first, end)]
        out[first:end] = torch.cat(rows).view(end - first, num_heads, head_dim)
    return out
