"""The torch path of attention over the paged cache (no native kernel: a CPU without a compiler): a row's result does
not depend on what is batched beside it, as the native kernel's does not."""

from __future__ import annotations

import pytest
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


def step(seqs: list[tuple[list[int], int, int]]) -> tuple[list[list[int]], list[int]]:
    """The rows of a CPU step as the runner hands them over: per (blocks, cached, new) sequence, one row per new
    token, each with the sequence's blocks up to its last new token and its own context."""
    tables, lens = [], []
    for blocks, cached, new in seqs:
        used = blocks[:-(-(cached + new) // BLOCK)]
        for ctx in range(cached + 1, cached + new + 1):
            tables.append(used)
            lens.append(ctx)
    return tables, lens


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 16), (8, 1, 32)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_attends_the_same_alone_or_beside_rows_of_other_contexts(
        heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype) -> None:
    """Every prompt row is attended as a decode on CPU (engine/model_runner.py), so a row's bits must depend on its
    query and its own context only: not on the chunk it came in, the other prompts beside it, nor their lengths. A
    row alone is a gather of its own blocks and one SDPA call, as every row was attended before chunks shared a
    gather: the bits are those."""
    gen = torch.Generator().manual_seed(1)
    # every slot holds something (a freed sequence's K/V): what a row must not read is not zero
    k_cache, v_cache = (torch.randn(64, BLOCK, kv_heads, dim, generator=gen).to(cache_dtype) for _ in range(2))
    blocks = torch.randperm(64, generator=gen).tolist()
    # (blocks, cached, new): a whole prompt, chunks after a prefix-cache hit (one inside a block), decodes
    seqs = [(blocks[0:5], 0, 70), (blocks[12:15], 16, 20), (blocks[16:19], 37, 5), (blocks[19:28], 130, 1),
            (blocks[28:30], 0, 17), (blocks[30:31], 3, 1)]
    tables, lens = step(seqs)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale = dim ** -0.5
    alone = [paged_attention(q[i:i + 1], k_cache, v_cache, decode_meta([tables[i][:-(-ctx // BLOCK)]], [ctx]),
                             scale)[0] for i, ctx in enumerate(lens)]
    first = [sum(n for _, _, n in seqs[:s]) for s in range(len(seqs))]  # each sequence's first row
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0], [2, 4], [0]):
        tables, lens = step([seqs[s] for s in order])
        rows = [first[s] + t for s in order for t in range(seqs[s][2])]
        got = paged_attention(q[rows], k_cache, v_cache, decode_meta(tables, lens), scale)
        differ = [(rows[r], lens[r]) for r in range(len(rows)) if not torch.equal(got[r], alone[rows[r]])]
        assert not differ, f"{len(differ)} rows whose bits changed beside {order}, (index, context): {differ[:4]}"
