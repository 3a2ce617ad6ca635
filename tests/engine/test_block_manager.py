"""The paged KV cache's bookkeeping, with no model: allocation, sharing by prefix hash, freeing, reuse."""

from __future__ import annotations

import random

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(temperature=0, max_tokens=8))


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """Admit `s` with its prefix hits and compute the rest of its prompt, as one step would."""
    hits = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_append_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert bm.allocate_slots(s, 10) and len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    s.output_token_ids += [99, 98]
    assert bm.allocate_slots(s, 1) and len(s.block_table) == 3  # token 11 still fits block 2
    s.num_computed_tokens = 11
    assert bm.allocate_slots(s, 1) and len(s.block_table) == 3
    s.num_computed_tokens, s.output_token_ids = 12, [*s.output_token_ids, 97]
    assert bm.allocate_slots(s, 1) and len(s.block_table) == 4  # token 13 opens a new block
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_computed_tokens == 0


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert not bm.allocate_slots(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_shared_prefix_blocks_are_reused_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(10)), "a")
    run_prefill(bm, a)
    b = seq([*range(8), 50, 51, 52], "b")  # shares two full blocks with a
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert bm.prefix_hit_rate == 8 / (10 + 11)


def test_freed_blocks_keep_their_hash_until_reallocated() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    follow_up = seq([*range(9), 7, 7, 7], "b")  # the next turn of the same chat
    hits = bm.get_computed_blocks(follow_up)
    assert len(hits) == 2
    assert bm.allocate_slots(follow_up, follow_up.num_tokens - 8, hits)
    bm.free(follow_up)
    other = seq([100 + i for i in range(16)], "c")  # needs every block: the cached ones are evicted
    assert bm.allocate_slots(other, 16)
    bm.free(other)
    assert bm.get_computed_blocks(seq(list(range(9)))) == []


def test_the_last_token_is_never_served_from_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)), "a")
    run_prefill(bm, a)
    again = seq(list(range(8)), "b")
    assert len(bm.get_computed_blocks(again)) == 1  # block 2 holds the last token: it must run for logits


def test_a_block_is_shared_only_once_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(12)), "a")
    assert bm.allocate_slots(a, 4)  # the first chunk is scheduled but not computed yet
    assert bm.get_computed_blocks(seq(list(range(12)), "b")) == []
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(seq(list(range(12)), "b")) == a.block_table[:1]


def test_blocks_are_shared_only_within_one_cache_salt() -> None:
    """The gateway salts each tenant's requests: another tenant's prefix is never a hit, so its time to first
    token tells nothing of what others sent."""
    bm = BlockManager(num_blocks=32, block_size=4)
    mine = seq(list(range(10)), "mine")
    mine.cache_salt = "tenant-a"
    run_prefill(bm, mine)
    theirs, again, unsalted = seq(list(range(10)), "theirs"), seq(list(range(10)), "again"), seq(list(range(10)), "u")
    theirs.cache_salt, again.cache_salt = "tenant-b", "tenant-a"
    assert bm.get_computed_blocks(theirs) == [] and bm.get_computed_blocks(unsalted) == []
    assert bm.get_computed_blocks(again) == mine.block_table[:2]  # the same tenant still shares its own


def test_an_end_users_salt_keeps_its_blocks_apart_but_counts_them_for_its_tenant() -> None:
    """`<tenant>.<end user>` salts (a plan isolating its end users): one end user's prefix is never another's hit,
    and the blocks in use count for the tenant (the ladder's KV trigger reads tenants, not end users)."""
    bm = BlockManager(num_blocks=32, block_size=4)
    alice = salted(list(range(10)), "acme.alice", "a")
    run_prefill(bm, alice)
    assert bm.get_computed_blocks(salted(list(range(10)), "acme.bob", "b")) == []
    assert bm.get_computed_blocks(salted(list(range(10)), "acme", "t")) == []
    assert bm.get_computed_blocks(salted(list(range(10)), "acme.alice", "a2")) == alice.block_table[:2]
    assert bm.used_by_salt == {"acme": 3}


def salted(tokens: list[int], salt: str | None, rid: str) -> Sequence:
    s = seq(tokens, rid)
    s.cache_salt = salt
    return s


def test_blocks_in_use_are_counted_by_salt_and_the_largest_holder_can_be_left_out() -> None:
    """The ladder's KV trigger reads what every tenant but the one holding most holds (tiers/fleet.py): counted as
    blocks leave and return to the free queue, shared prefix blocks once, for the salt whose chain they are on."""
    bm = BlockManager(num_blocks=32, block_size=4)
    big = [salted([*range(16), 100 + i], "flood", f"f{i}") for i in range(3)]  # a 16-token shared prefix
    for s in big:
        run_prefill(bm, s)
    assert bm.used_by_salt == {"flood": 4 + 3} == {"flood": bm.num_used_blocks}  # the prefix once, a tail each
    assert bm.num_used_blocks_but_largest == 7  # one tenant alone: it counts whole
    small = salted(list(range(6)), "victim", "v")
    run_prefill(bm, small)
    assert bm.used_by_salt == {"flood": 7, "victim": 2} and bm.num_used_blocks_but_largest == 2
    for s in big:
        bm.free(s)
    assert bm.used_by_salt == {"victim": 2} and bm.num_used_blocks == 2
    again = salted([*range(16), 7], "flood", "f9")  # its prefix back from the free queue, as a hit
    run_prefill(bm, again)
    assert bm.used_by_salt == {"flood": 5, "victim": 2} == {"flood": 5, "victim": bm.num_used_blocks - 5}
    bm.free(again)
    bm.free(small)
    assert bm.used_by_salt == {} and bm.num_used_blocks == 0


def test_the_counts_by_salt_always_add_up_to_the_blocks_in_use() -> None:
    """Random admissions (shared prefixes, several salts, decode growth) and frees, against the free queue."""
    rng = random.Random(7)
    bm = BlockManager(num_blocks=40, block_size=4)
    live: list[Sequence] = []
    for step in range(2000):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.5:  # a decode step of one of them
            s = rng.choice(live)
            s.output_token_ids.append(rng.randrange(50))
            if bm.allocate_slots(s, 1):
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
        else:
            salt = rng.choice(["a", "b", "c", None])
            s = salted([*range(rng.choice([4, 8, 12])), *(rng.randrange(50) for _ in range(rng.randrange(1, 9)))],
                       salt, f"r{step}")
            hits = bm.get_computed_blocks(s)
            if bm.allocate_slots(s, s.num_tokens - len(hits) * bm.block_size, hits):
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
                live.append(s)
        assert sum(bm.used_by_salt.values()) == bm.num_used_blocks, step
        assert 0 <= bm.num_used_blocks_but_largest <= bm.num_used_blocks
