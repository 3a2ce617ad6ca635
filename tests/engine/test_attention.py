"""The torch path of attention over the paged cache (no native kernel: a CPU without a compiler): a row's result does
not depend on what is batched beside it, as the native kernel's does not."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def decode_meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    """As the runner builds it without the native kernel: tables padded to the longest context, a padding mask."""
    ctx = max(lens)
    table = torch.zeros(len(lens), -(-ctx // BLOCK), dtype=torch.long)
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = torch.tensor(blocks)
    mask = (torch.arange(ctx)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :] if min(lens) < ctx else None
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decode_seqs=len(lens), decode_block_tables=table,
        decode_mask=mask, decode_context_len=ctx, decode_context_lens=torch.tensor(lens), prefill_query_starts=[],
        prefill_query_lens=[], prefill_block_tables=[], prefill_context_lens=[])


def test_a_decode_attends_the_same_alone_or_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(80, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    seqs = [(37, [0, 1, 2]), (300, list(range(3, 22))), (5, [22]), (700, list(range(22, 66)))]  # (context, blocks)
    q = torch.randn(len(seqs), HEADS, DIM, generator=gen)
    alone = [paged_attention(q[i:i + 1], k_cache, v_cache, decode_meta([blocks], [ctx]), DIM ** -0.5)[0]
             for i, (ctx, blocks) in enumerate(seqs)]
    for batch in ([0, 1], [0, 3], [2, 0], [0, 1, 2, 3]):
        got = paged_attention(q[batch], k_cache, v_cache,
                              decode_meta([seqs[i][1] for i in batch], [seqs[i][0] for i in batch]), DIM ** -0.5)
        for row, i in enumerate(batch):
            assert torch.equal(got[row], alone[i]), (batch, i)
