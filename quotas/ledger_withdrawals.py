"""Which of the ledger's pending rows may still be withdrawn (quotas/ledger.py `Ledger.wait_durable`), decided under
one lock between the event loop, which withdraws, and the writer thread, which takes rows to commit.

A row is queued (withdrawable: withdrawn at once, its future failed with `RowWithdrawn`, and dropped by the writer
when it takes it), or in flight (sent to a commit: not withdrawable, a withdrawal asked now is pending and its commit
decides), until its future is settled on the loop, or it comes back from a commit that did not write it (queued
again; withdrawn then if its withdrawal was pending). A row is never both withdrawn and written: the loop's check and
the writer's taking are one under the lock, and a committed row stays in flight until its future says so.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any


class LedgerUnavailable(Exception):
    """The ledger could not make a row durable in time (disk full, database locked or down, I/O error)."""


class RowWithdrawn(LedgerUnavailable):
    """A row not durable in time that was withdrawn (`wait_durable(withdraw=True)`): it never commits."""


Future = asyncio.Future[None]


class Withdrawals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending: set[Future] = set()  # rows sent to commit, until their fate is known on the loop
        self._withdrawing: set[Future] = set()  # of those, rows to withdraw if their commit did not write them
        self._withdrawn: set[Future] = set()  # withdrawn while queued: the writer drops them when it takes them

    def withdraw(self, written: Future) -> bool:
        """On the loop: True if the row was queued and is withdrawn now (its future failed); False if its fate is
        known already, or it is in flight (its withdrawal pending: its future fails if its commit did not write it)."""
        with self._lock:
            if written.done():
                return False
            if written in self._sending:
                self._withdrawing.add(written)
                return False
            self._withdrawn.add(written)
        written.set_exception(RowWithdrawn("a usage row was withdrawn before it was written"))
        written.exception()  # retrieved: the caller's wait raises it; a follower may never look
        return True

    def pending(self, written: Future) -> bool:
        """Its withdrawal was asked while it was in flight, and its commit has not decided yet."""
        with self._lock:
            return written in self._withdrawing

    def claim(self, rows: list[Any]) -> list[Any]:
        """On the writer: the rows (`Pending`: their future second) to send to commit now, those withdrawn dropped;
        the others are in flight from here."""
        with self._lock:
            if self._withdrawn:
                kept = [p for p in rows if p[1] not in self._withdrawn]
                self._withdrawn.difference_update(p[1] for p in rows)
                rows = kept
            self._sending.update(p[1] for p in rows if p[1] is not None)
        return rows

    def returned(self, rows: list[Any]) -> tuple[list[Any], list[Future]]:
        """On the writer: rows back from a commit that did not write them. The rows queued again, and the futures of
        those whose withdrawal was pending, to be failed with `RowWithdrawn` (they stay in flight until they are:
        never withdrawn twice)."""
        back: list[Any] = []
        gone: list[Future] = []
        with self._lock:
            for p in rows:
                if p[1] is not None and p[1] in self._withdrawing:
                    gone.append(p[1])
                else:
                    self._sending.discard(p[1])
                    back.append(p)
        return back, gone

    def settled(self, futures: Iterable[Future | None]) -> None:
        """On the loop, in the turn that settled them: their fate is known."""
        with self._lock:
            for fut in futures:
                self._sending.discard(fut)  # type: ignore[arg-type]
                self._withdrawing.discard(fut)  # type: ignore[arg-type]


async def until(written: Future, timeout_s: float | None) -> None:
    """Wait until `written` is done or `timeout_s` has passed (None: no bound), never cancelling it. One waiter woken
    by the row or by a timer: costs what `shield` alone did (asyncio.timeout on top of it added about 15 us a call)."""
    if written.done():
        return
    loop = asyncio.get_running_loop()
    waiter: Future = loop.create_future()
    written.add_done_callback(lambda _: wake(waiter))
    timer = None if timeout_s is None else loop.call_later(timeout_s, wake, waiter)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()


def withdrawn(written: Future) -> bool:
    """Whether the row of `written` was withdrawn (`Ledger.wait_durable`): it never commits, and bills nothing."""
    return written.done() and not written.cancelled() and isinstance(written.exception(), RowWithdrawn)


def wake(waiter: Future) -> None:
    if not waiter.done():
        waiter.set_result(None)

