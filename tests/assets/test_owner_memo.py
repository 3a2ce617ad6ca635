"""OwnerMemo's bounds (assets/owner_memo.py): each owner's values evicted by its own past `per_owner`, whole memos past
`owners`, and, where `total` is set, the least recently active owner's oldest values past `total` in all, so a busy
owner may hold up to `per_owner` alone."""

from __future__ import annotations

from assets.owner_memo import OwnerMemo


def held(memo: OwnerMemo[int], owner: str, keys: range) -> int:
    return sum(memo.get(owner, k) is not None for k in keys)


def test_one_owner_may_hold_up_to_per_owner_under_the_total() -> None:
    memo: OwnerMemo[int] = OwnerMemo(per_owner=400, owners=64, total=1000)
    for k in range(400):
        memo.put("busy", k, k)
    assert held(memo, "busy", range(400)) == 400  # not total / owners (15)
    memo.put("busy", 400, 400)
    assert memo.get("busy", 0) is None and memo.get("busy", 400) == 400  # its own oldest, past per_owner


def test_past_the_total_the_least_recently_active_owners_oldest_go() -> None:
    memo: OwnerMemo[int] = OwnerMemo(per_owner=400, owners=64, total=1000)
    for owner in ("a", "b", "c"):
        for k in range(300):
            memo.put(owner, k, k)
    memo.get("a", 299)  # a is active again: b is now the least recently active
    for k in range(300):
        memo.put("d", k, k)  # 1,200 put in all: 200 over the total
    assert held(memo, "b", range(300)) == 100 and memo.get("b", 0) is None  # b's oldest 200 went
    assert held(memo, "a", range(300)) == held(memo, "c", range(300)) == held(memo, "d", range(300)) == 300


def test_the_size_follows_pops_replacements_and_dropped_owners() -> None:
    memo: OwnerMemo[int] = OwnerMemo(per_owner=10, owners=2, total=15)
    for k in range(10):
        memo.put("a", k, k)
        memo.put("a", k, k + 1)  # a replacement adds nothing
    assert memo.pop("a", 0) == 1 and memo.pop("a", 0) is None
    for k in range(10):
        memo.put("b", k, k)
    assert held(memo, "a", range(10)) == 5  # 19 put, 15 kept: a's oldest 4 went
    memo.get("b", 9)  # b the most recently active: a goes next
    for k in range(10):
        memo.put("c", k, k)  # a third owner: a's memo dropped whole, with its count
    assert held(memo, "a", range(10)) == 0
    assert held(memo, "b", range(10)) + held(memo, "c", range(10)) == 15
