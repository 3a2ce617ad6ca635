"""Wake-ups between the event loop and the ledger's writer thread (quotas/ledger.py), each made with the GIL let go.

At one request at a time every answer waits for its row's commit: the loop hands the row to the writer, and the
writer hands the commit's outcome back. A wake-up made while holding the GIL (`SimpleQueue.put` releasing the
writer's lock; uvloop's `call_soon_threadsafe`, a C call that keeps it) lets the woken thread take the core only to
find the GIL held and sleep again; the waker runs on to its own wait, and only then does the woken one run: three
context switches where one would do, and on a loaded core each is a chance for another process to run first. Here
each side wakes the other by writing a byte to a pipe the other waits on (`os.write` lets the GIL go around its
system call), so the woken thread takes the GIL at once and the waker's remaining steps wait for it instead.

A throwaway timing of the ledger's round trip (submit, then wait for the commit), one row at a time under uvloop on
one core (2026-12-07, AMD EPYC Zen 3, loaded by other work), medians of 5 runs taking turns: p50 289 µs before, 229
with the hand-back alone, 199 with both; CPU 320, 265, 233 µs a row; context switches 3.1, 2.3, 2.1 a row
(BENCHMARKS.md, session 46).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any

log = logging.getLogger("tiergate.ledger")


class LoopHandBack:
    """`send(*args)` from any thread runs `target(*args)` on `loop`'s thread, in the order sent; made on that thread.
    Once the loop is closed nothing runs any more: a send then is dropped, as `call_soon_threadsafe`'s would be."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: Callable[..., None]) -> None:
        self._loop = loop
        self._target = target
        self._sent: deque[tuple[Any, ...]] = deque()  # append and popleft are atomic: no lock
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe means a wake-up is pending already
        self._open = True
        loop.add_reader(self._read_fd, self._run)

    def send(self, *args: Any) -> None:
        if not self._open or self._loop.is_closed():
            return
        self._sent.append(args)
        with suppress(BlockingIOError):  # full: the loop has bytes to read, and reads the deque to its end
            os.write(self._write_fd, b"\0")

    def _run(self) -> None:
        with suppress(BlockingIOError):
            os.read(self._read_fd, 4096)  # more left: the reader fires again, and finds the deque empty
        self._run_sent()

    def _run_sent(self) -> None:
        while self._sent:
            args = self._sent.popleft()
            try:
                self._target(*args)
            except Exception:  # as the loop's handler would log a failed callback; the next ones still run
                log.exception("a hand-back from the ledger's writer failed")

    def close(self) -> None:
        """Run what was sent and not run yet (the loop may have been blocked in the caller meanwhile, as in the
        ledger's `close`), stop watching the pipe and close it: after the last `send` (one afterwards could write to
        a descriptor reused meanwhile). From another thread while the loop runs, that is done on the loop's thread."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop and self._loop.is_running():
            with suppress(RuntimeError):  # closed meanwhile: then there is no reader to take off
                self._loop.call_soon_threadsafe(self.close)
            return
        if not self._open:
            return
        self._open = False
        if not self._loop.is_closed():
            self._run_sent()
            self._loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)


class Nudges:
    """A thread sleeps in `wait` until some other thread calls `nudge` (after queuing what it is to find); nudges
    while it is awake are taken together at its next wait, which then returns at once."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # a full pipe means a nudge is pending already
        self._open = True

    def nudge(self) -> None:
        if self._open:
            with suppress(BlockingIOError):
                os.write(self._write_fd, b"\0")

    def wait(self) -> None:
        os.read(self._read_fd, 4096)

    def close(self) -> None:
        """Once the waiting thread has ended, and no nudge can come any more."""
        if self._open:
            self._open = False
            os.close(self._read_fd)
            os.close(self._write_fd)
