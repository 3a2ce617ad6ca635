"""The wake-ups between the event loop and the ledger's writer (quotas/ledger_wakeups.py): calls sent from a thread
run on the loop's thread, in order, and none is lost when the loop was blocked until the hand-back closes; a nudge
given while nobody waits is not lost either."""

from __future__ import annotations

import asyncio
import threading

from quotas.ledger_wakeups import LoopHandBack, Nudges


async def test_calls_from_a_thread_run_on_the_loop_thread_in_order() -> None:
    ran: list[tuple[int, int]] = []
    done = asyncio.Event()

    def target(i: int) -> None:
        ran.append((i, threading.get_ident()))
        if i == 999:
            done.set()

    hand_back = LoopHandBack(asyncio.get_running_loop(), target)
    sender = threading.Thread(target=lambda: [hand_back.send(i) for i in range(1000)])
    sender.start()
    await asyncio.wait_for(done.wait(), 5)
    sender.join()
    hand_back.close()
    assert [i for i, _ in ran] == list(range(1000))
    assert {thread for _, thread in ran} == {threading.get_ident()}


async def test_closing_runs_what_was_sent_while_the_loop_was_blocked() -> None:
    ran: list[int] = []
    hand_back = LoopHandBack(asyncio.get_running_loop(), ran.append)
    sender = threading.Thread(target=hand_back.send, args=(7,))
    sender.start()
    sender.join()  # the loop is blocked here: the pipe's byte is not read yet
    hand_back.close()
    assert ran == [7]
    hand_back.send(8)  # after closing: dropped
    await asyncio.sleep(0)
    assert ran == [7]


def test_a_send_after_the_loop_closed_is_dropped() -> None:
    ran: list[int] = []
    loop = asyncio.new_event_loop()
    hand_back = LoopHandBack(loop, ran.append)
    loop.close()
    hand_back.send(1)
    hand_back.close()
    assert ran == []


def test_a_nudge_before_the_wait_is_not_lost_and_nudges_wake_one_wait() -> None:
    nudges = Nudges()
    for _ in range(3):
        nudges.nudge()  # while the waiter is busy elsewhere: its next wait returns at once
    nudges.wait()
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: (nudges.wait(), woken.set()))
    waiter.start()
    assert not woken.wait(0.05)  # the three were taken together
    nudges.nudge()
    assert woken.wait(5)
    waiter.join()
    nudges.close()
    nudges.nudge()  # closed: nothing
