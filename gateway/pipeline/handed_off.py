"""Work a request hands off: it runs to its end even if the request leaves (a client gone, a timeout), its failure
is logged, and shutdown waits for it (`drain`) before the stores it uses close.

The request path hands off what must not be lost with the request's task: a quota settle (settle.py), giving back
what a reserve or an Idempotency-Key claim admitted after its request left (reserve.py, idempotency.py), an
embeddings answer's settle and kept answer (gateway/embeddings_settle.py). Each holds its tasks here: a task
nobody holds may be collected before it ends, and a failure nobody retrieves is never seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class HandedOff:
    def __init__(self, log: logging.Logger, failed: str) -> None:
        """`failed`: what the log says when a handed-off task fails ("<failed>: <the error>")."""
        self._log = log
        self._failed = failed
        self._tasks: set[asyncio.Future[Any]] = set()

    def run(self, work: Awaitable[T], failed: str | None = None) -> asyncio.Future[T]:
        """Run `work` to its end whatever happens to the caller; a failure is logged (`failed`, or the default)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, failed or self._failed))
        return task

    def adopt(self, work: asyncio.Future[T], then: Callable[[asyncio.Future[T]], object]) -> None:
        """Hold `work` (already running, its caller gone) until it ends, then call `then` with it (which may hand
        off more: a give-back of what `work` admitted)."""
        self._tasks.add(work)

        def done(w: asyncio.Future[T]) -> None:
            self._tasks.discard(w)
            then(w)

        work.add_done_callback(done)

    def _done(self, task: asyncio.Future[Any], failed: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("%s: %s", failed, task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self) -> None:
        """Wait until no handed-off work is left, including work handed off while waiting (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
