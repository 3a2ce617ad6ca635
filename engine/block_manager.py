"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and the prefix cache.

Pure Python (the runner owns the tensors; a block id is an index into them), so it is tested without a
model. A full block is named by a hash of its tokens chained to its parent block's hash, so two
sequences that start with the same tokens share the same blocks. A block is hashed only once its K/V
have been computed, so a prefix hit never reads a block that is still being filled. Freed blocks keep
their hash and go to the back of the free queue: a later request with the same prefix takes them back
until they are reallocated, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] = ()  # the block's tokens, to confirm a hash hit


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix hash of a full block: its tokens chained to everything before them."""
    return hash((parent_hash, token_ids))


def root_hash(seq: Sequence) -> int | None:
    """What a sequence's first block chains to: its cache salt, so blocks are shared only within one salt. Without
    it a tenant could tell, by its time to first token (0.05 s against 0.83 s for a 700-word system prompt), whether
    another tenant had just sent a prefix it guessed."""
    return None if seq.cache_salt is None else hash(("cache_salt", seq.cache_salt))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evict from front
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        # blocks in use by the salt's tenant (sequence.salt_tenant: the gateway's per-tenant digest): a block is shared
        # only between sequences of one salt (its hash chain starts from the salt), so each used block is one tenant's
        self.used_by_salt: dict[str | None, int] = {}
        self.num_prefix_hit_tokens = 0  # of those, tokens whose K/V were reused

    # ---- sizes ----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def num_used_blocks_but_largest(self) -> int:
        """Blocks in use by every salt but the one holding the most (all of them when one salt holds every used
        block): what the other tenants' sequences hold. Read lock-free from another thread: on a dict the step
        thread resizes meanwhile, the total instead."""
        try:
            held = list(self.used_by_salt.values())
        except RuntimeError:
            return self.num_used_blocks
        return sum(held) - max(held) if len(held) > 1 else sum(held)

    def _hold(self, salt: str | None, n: int) -> None:
        left = self.used_by_salt.get(salt, 0) + n
        if left:
            self.used_by_salt[salt] = left
        else:
            self.used_by_salt.pop(salt, None)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`'s tokens (never its last token, which must run)."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.token_ids
        hits: list[int] = []
        parent = root_hash(seq)
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more K/V of `seq`, first taking `computed_blocks` (prefix hits).

        Returns False, changing nothing, when the free blocks do not suffice.
        """
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(computed_blocks)
        num_hits_in_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(num_needed, 0) > self.num_free_blocks - num_hits_in_free:
            return False
        if not seq.block_table:  # admission: count the lookup
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self._hold(seq.tenant, 1)
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
        seq.num_computed_tokens = num_computed
        seq.num_cached_tokens = max(seq.num_cached_tokens, len(computed_blocks) * self.block_size)
        for _ in range(max(num_needed, 0)):
            seq.block_table.append(self._take_free_block())
        if num_needed > 0:
            self._hold(seq.tenant, num_needed)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of `seq` that are now full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), num_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq)
            block_hash = hash_block(parent, chunk)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and block_hash not in self.hash_to_block_id:
                block.block_hash, block.token_ids = block_hash, chunk
                self.hash_to_block_id[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds become free but keep their hash for reuse."""
        for block_id in reversed(seq.block_table):  # the tail goes first, so shared prefixes live longest
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                self._hold(seq.tenant, -1)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
