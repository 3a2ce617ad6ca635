"""FairSlots (cache/fair_slots.py): a freed slot goes to the waiting owner holding the fewest."""

from __future__ import annotations

import threading
import time

import pytest

from cache.fair_slots import FairSlots


def waiter(slots: FairSlots, owner: str, got: list[str], timeout: float = 5.0) -> threading.Thread:
    def wait() -> None:
        if slots.acquire(owner, timeout):
            got.append(owner)

    t = threading.Thread(target=wait)
    t.start()
    return t


def settle() -> None:
    time.sleep(0.05)  # the threads started are waiting on the condition


def test_a_freed_slot_goes_to_the_owner_holding_none_not_to_the_flood_waiting_first() -> None:
    slots, got = FairSlots(2), []
    assert slots.acquire("flood", 0) and slots.acquire("flood", 0)
    floods = [waiter(slots, "flood", got) for _ in range(4)]
    settle()
    victim = waiter(slots, "acme", got)  # came last
    settle()
    slots.release("flood")
    victim.join(2)
    assert got == ["acme"] and slots.held("acme") == 1 and slots.held("flood") == 1
    slots.release("acme")  # now the flood's waiters take the slots, one at a time
    settle()
    assert got == ["acme", "flood"] and slots.held("flood") == 2
    for _ in range(3):  # the flood's three other waiters
        slots.release("flood")
        settle()
    for t in floods:
        t.join(2)
    assert got == ["acme"] + ["flood"] * 4 and slots.held("flood") == 2


def test_owners_waiting_alike_take_turns() -> None:
    slots, got = FairSlots(1), []
    assert slots.acquire("x", 0)
    threads = []
    for owner in ("a", "a", "a", "b", "b"):
        threads.append(waiter(slots, owner, got))
        settle()
    for _ in range(5):
        holder = got[-1] if got else "x"
        slots.release(holder)
        settle()
    for t in threads:
        t.join(2)
    assert got == ["a", "b", "a", "b", "a"]


def test_one_owner_alone_may_hold_every_slot_and_a_wait_ends_at_its_timeout() -> None:
    slots = FairSlots(3)
    assert all(slots.acquire("only", 0) for _ in range(3))
    began = time.monotonic()
    assert not slots.acquire("other", 0.1)
    assert time.monotonic() - began >= 0.1
    slots.release("only")
    assert slots.acquire("other", 0)  # a timed-out waiter left nothing behind that holds the line
    with pytest.raises(RuntimeError):
        slots.release("nobody")
    with pytest.raises(ValueError):
        FairSlots(0)
