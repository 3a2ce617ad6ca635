"""An Idempotency-Key's claim while its request runs (`Keep`), and after it is answered (`keep_when_written`).

Split from idempotency.py, whose `IdempotencyStage` claims a key, replays a stored answer and renews the claim's
lease: this module holds what the request path keeps in hand between the claim and the answer's store. `Keep` is
the claim's lifetime on the request's side: given up unless answered, the request stopped if its lease is lost
(its client told `lease_lost()`), and, once the answer is handed to the store with its ledger row, the answer's.
`keep_when_written` follows that row to its final outcome, off the request's path: the answer kept once the row
commits, the claim given up if it is refused for good. Both are used by handle.py, cascade.py and the embeddings
route (gateway/embeddings_service.py, gateway/embeddings_settle.py); idempotency.py re-exports them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import Unavailable
from quotas.idempotency import Claim, IdempotencyStore
from quotas.ledger_withdrawals import withdrawn

log = logging.getLogger("tiergate.idempotency")  # idempotency.py's logger: one name for the Idempotency-Key's logs


def lease_lost() -> Unavailable:
    """What the client of a request stopped for its lost lease is told (`Keep`)."""
    return Unavailable("Idempotency-Key: this request's claim on its key could not be renewed before it could end (the "
                       "idempotency records could not be reached), so the request was stopped, lest a retry with the "
                       "key run it a second time; what it ran is billed; retry with the same key",
                       param="Idempotency-Key", code="idempotency_lease_lost", retry_after=1)


class Keep:
    """A request's claim on its Idempotency-Key, and whether its answer has been handed to the store (from then on the
    claim is the answer's, never given up); a claim whose answer was not stored when the request ends is given up
    (gateway/pipeline/handle.py).

    Its lease is renewed while the request runs (`renewal`, `IdempotencyStage.renewing`); a renewal task that ends by
    itself has lost the lease (it may have ended: a retry with the key may claim it and run). The request is then
    stopped unless its answer is stored already: the task running its code is cancelled, which settles it as a client
    that left is (billed for what ran), and `stopped` tells the request that cancel was this, to answer `lease_lost()`.
    Which task runs its code: the one that made the Keep, and for an async generator (handle.py) the one that resumed it
    last; none while it is suspended at a `yield` (`suspend`; the task then runs its consumer's code, never cancelled
    for this). A lease lost while it is suspended stops its work at once, in a task of its own (`suspend`'s `stop`:
    handle.py closes the answer's events, which settles it as a client that left is, frees the tier's and the tenant's
    slots and gives the claim up), and its client is told `lease_lost()` as it resumes (`resume`). Stopped only as it
    resumed, a stream whose client did not read (the send held by flow control, until the stall cut's 60 s) kept its
    slots and its claim meanwhile, while a retry could take the expired key over and run."""

    def __init__(self, claim: Claim, renewal: asyncio.Task[str] | None = None) -> None:
        self.claim = claim
        self.stored = False
        self._row: asyncio.Future[None] | None = None  # the ledger row the stored answer goes with (`kept_with`)
        self.renewal = renewal  # the claim's lease renewed while the request runs (`IdempotencyStage.renewing`)
        self.lost = False  # the lease may have ended while the request ran
        self._runs: asyncio.Task[Any] | None = asyncio.current_task()  # the task running the request's code now
        self._cancelled: asyncio.Task[Any] | None = None  # the task cancelled for the lost lease, not yet told
        self._stop: Callable[[], Awaitable[None]] | None = None  # ends its work while it is suspended (`suspend`)
        self._stopping: asyncio.Task[None] | None = None  # that stop, begun for a lease lost while suspended
        self._settled = False
        if renewal is not None:
            renewal.add_done_callback(self._renewal_ended)

    def kept_with(self, written: asyncio.Future[None]) -> None:
        """The answer is handed to the store with its ledger row (`written`, the ledger's future for it): the claim is
        the answer's from here (`keep_when_written` follows the row), unless the row is withdrawn (`row_withdrawn`)."""
        self.stored, self._row = True, written

    def row_withdrawn(self, written: asyncio.Future[None]) -> bool:
        """The row `written` was withdrawn (a JSON answer's, late past the ledger's wait), its answer with it: the
        claim is no longer that answer's. Said by the request that saw the withdrawal and by `keep_when_written`,
        whichever comes first. While the request runs, the claim is its own again (`stored` False): given up as it
        ends, or the key's answer another one the client gets (a cascade's first answer, which stands:
        gateway/pipeline/cascade.py). True where the request is over and the claim still the row's: the caller gives it
        up (nothing else will). A claim some other answer took since (`stored` again) is left alone."""
        if self._row is not written:
            return False
        self.stored, self._row = False, None
        return self._settled

    def settle(self) -> bool:
        """The request is over: its lease is renewed no more (a kept answer's record is `done`; a claim given up, or
        one whose gateway died, frees its key when its lease ends), nor is it stopped for its lease. True the first
        time (the caller gives an unstored claim up then: once, whether the request ended or its `stop` ended it)."""
        first = not self._settled
        self._runs, self._stop, self._settled = None, None, True
        if self.renewal is not None:
            self.renewal.cancel()
        return first

    def suspend(self, stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """The request's code is suspended (a generator at its `yield`): its task is its consumer's until `resume`.
        `stop`: what ends its work should its lease be lost meanwhile, run then in a task of its own; nothing else may
        touch what it closes until `halted`."""
        self._runs, self._stop = None, stop

    async def halted(self) -> None:
        """Wait for the `stop` a lease lost while the request was suspended began, if it did (what it closes is
        closed then); none begins after this is asked (the request closes what it would). Its failure was logged by
        it."""
        self._stop = None
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    def resume(self) -> None:
        """The request's code runs again, in the current task; `lease_lost()` raised if its lease was lost meanwhile
        (its `stop` may still run: the caller awaits `halted` before it touches what that closes)."""
        self._runs, self._stop = asyncio.current_task(), None
        if self.lost and not self.stored:
            if self._cancelled is not None:  # a cancel swallowed on the way: taken back, the error said instead
                self._cancelled.uncancel()
                self._cancelled = None
            raise lease_lost()

    def stopped(self) -> bool:
        """Asked of a CancelledError the request caught: True when it is this Keep's cancel for a lost lease and
        nothing else cancels the task (taken back then: the caller raises `lease_lost()` instead)."""
        task = asyncio.current_task()
        if task is None or self._cancelled is not task:
            return False
        self._cancelled = None
        return task.uncancel() == 0

    def _renewal_ended(self, renewal: asyncio.Task[str]) -> None:
        if renewal.cancelled() or self._settled:  # the request is over
            return
        self.lost = True
        exc = renewal.exception()  # a bug: the lease is not renewed any more, so it is lost
        if self.stored:  # answered: its claim is the answer's now, whatever its lease
            return
        log.error("Idempotency-Key %r (tenant %s): %s; its request is stopped, lest the key run twice", self.claim.key,
                  self.claim.tenant, "its renewals failed" if exc else renewal.result(), exc_info=exc)
        if self._runs is None:  # suspended: its work stopped now, its client told as it resumes (`resume`)
            if self._stop is not None:
                self._stopping = asyncio.get_running_loop().create_task(self._stopped(self._stop))
                self._stop = None
            return
        self._cancelled = self._runs
        self._runs.cancel()

    async def _stopped(self, stop: Callable[[], Awaitable[None]]) -> None:
        """`stop`, for a lease lost while the request was suspended (`suspend`)."""
        try:
            await stop()
        except Exception:
            log.exception("stopping the request of Idempotency-Key %r (tenant %s) for its lost lease failed",
                          self.claim.key, self.claim.tenant)


KEEP_FOR_S = 120.0  # how long a kept claim waits for its row's final outcome here, then its store follows the row


async def keep_when_written(store: IdempotencyStore, written: asyncio.Future[None], keep: Keep,
                            answer: dict[str, Any], ttl_s: float, *, for_s: float = KEEP_FOR_S) -> None:
    """The claim of an answer whose ledger row was queued (`written`, the ledger's future for it), once the row's fate
    is final, not when the request's wait for it ends: committed, the answer is kept (`finish`: a store that commits it
    with the row, SQLite and PostgreSQL, has done so); refused for good (the database refused the row, or the ledger
    closed with it unwritten), the row and the answer committed with it are not, and the claim is given up so that a
    retry runs; withdrawn (`Keep.row_withdrawn`), the claim is the request's again while it runs, and given up here
    only once it is over. Until then the key stays claimed (a retry waits, or gets 409): a row late past the request's
    wait is still written, billed, and its answer must be what a retry gets. A row still pending after `for_s` (the
    ledger down that long) is handed to the store (`finish_when_written`), which follows it however late, with no task
    held open (a shutdown does not wait on it): SQLite and PostgreSQL commit the answer with the row, Redis stores it
    once the row commits. Run it handed off: it outlives the request."""
    claim = keep.claim
    await asyncio.wait((written,), timeout=for_s)  # never cancels the ledger's future (the writer settles it)
    if not written.done():  # the store follows the row from here, however late it commits (no task held open)
        log.warning("Idempotency-Key %r (tenant %s): its ledger row is not written after %g s; its store keeps the "
                    "answer once it commits", claim.key, claim.tenant, for_s)
        # withdrawn later, the claim is given up there only as it would be here (`Keep.row_withdrawn`): while the
        # request runs it is the request's (a cascade's first answer may be the key's), and given up as it ends
        store.finish_when_written(written, claim, answer, ttl_s,
                                  give_up=lambda row: not withdrawn(row) or keep.row_withdrawn(row))
        return
    if withdrawn(written):  # the request's, if it still runs (a cascade's first answer may be the key's now)
        if keep.row_withdrawn(written):
            await store.abandon(claim)
        return
    if written.cancelled() or written.exception() is not None:
        await store.abandon(claim)
        if not written.cancelled():
            raise written.exception()  # type: ignore[misc]  # logged by the hand-off, the claim given up
        return
    await store.finish(claim, answer, ttl_s)
