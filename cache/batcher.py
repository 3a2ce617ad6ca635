"""One MiniLM forward pass for the texts of many concurrent requests.

Every deterministic request that reaches the semantic layer needs the vector of its last user turn. Embedded
one at a time, each pays the forward's fixed cost (tokenizer, dispatch, small matrix products that leave the
core idle) and waits behind all the others in the worker thread. `EmbeddingBatcher` queues texts from the event
loop and runs them together in its one worker thread (the forward releases the GIL, so the loop keeps serving):

- a batch starts when `max_batch` texts are queued, or `max_wait_s` after its first text arrived, or at once
  when no other lookup has announced a text (`announce`): a lone request is never held back for company;
- texts that arrive while a forward runs form the next batch, which starts the moment that forward ends;
- equal texts of one owner in one batch are embedded once (never across owners: a tenant must not learn, from
  a batch one text shorter, that another tenant sent its text at the same moment);
- a batch takes its texts in turns from the callers' owners (a tenant, say), oldest first within each: one
  owner's thousands of queued texts do not make another's one text wait for all of them, only for a batch.

The queue is a lane of texts per owner and a round of the owners with texts queued, so a batch costs the event loop
its own texts, whatever waits behind it. It was one list, split into lanes again for every batch: each batch cost the
whole queue, and a queue of N texts cost N^2 / max_batch in all (10 requests of 2,048 texts queued: 8.6 ms of the
loop a batch of 32, 5.5 s in all; 50 of them, 30 ms and 95 s). A text whose caller left is dropped when its turn
comes.

Only the event loop touches the queue; the worker thread sees one list of texts at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

# Turns texts into their vectors (None for a text that is not embedded), in the worker thread.
EncodeMany = Callable[[list[str]], list[np.ndarray | None]]


class Queued(NamedTuple):
    text: str
    future: asyncio.Future[np.ndarray | None]  # its caller's (done: the caller left)
    owner: Hashable
    order: int  # when it was queued: a batch is handed over in this order


class Announcement:
    """A lookup that will soon hand the batcher a text: while any is open, a new batch waits (up to its budget)."""

    def __init__(self, batcher: EmbeddingBatcher) -> None:
        self._batcher = batcher
        self.open = True

    def close(self) -> None:
        """The text was queued, or will never come; idempotent."""
        if self.open:
            self.open = False
            self._batcher._announced -= 1
            self._batcher._schedule()

    def __enter__(self) -> Announcement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddingBatcher:
    """Batches `embed` calls of one event loop into forward passes of up to `max_batch` texts."""

    def __init__(self, encode_many: EncodeMany, *, max_batch: int = 32, max_wait_s: float = 0.003) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError("max_batch must be at least 1 and max_wait_s at least 0")
        self.encode_many = encode_many
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.num_batches = 0  # forward passes run (for metrics and tests)
        self.num_texts = 0  # texts embedded in them
        self._lanes: dict[Hashable, deque[Queued]] = {}  # owner -> its queued texts, oldest first (none empty)
        self._round: deque[Hashable] = deque()  # the owners of `_lanes`, the one whose turn is next first
        self._num_queued = 0  # texts in the lanes, those whose callers left included until their turn
        self._order = itertools.count()
        self._busy: asyncio.AbstractEventLoop | None = None  # the loop whose forward pass is running
        self._announced = 0
        self._timer: asyncio.TimerHandle | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergate-embed")

    def announce(self) -> Announcement:
        """Say a text is coming (use as a context manager, or hand it to `embed`, which closes it)."""
        self._announced += 1
        return Announcement(self)

    async def embed(self, text: str, announcement: Announcement | None = None, *,
                    owner: Hashable = None) -> np.ndarray | None:
        """The vector of `text` ([dim] float32), or None where `encode_many` gives none. Batches take turns
        between `owner`s."""
        (future,) = self._queue([text], owner)
        if announcement is not None and announcement.open:
            announcement.close()  # schedules
        else:
            self._schedule()
        return await future

    def embed_many(self, texts: list[str], *, owner: Hashable = None) -> list[asyncio.Future[np.ndarray | None]]:
        """Queue `texts` together: a future for each one's vector (as `embed`'s). A future cancelled (its caller
        left) drops its text from the batches to come. One call for a request's texts, not an `embed` task each: 2,048
        tasks made and run at once held the event loop about 7 ms (their futures queued at once: 2.3 ms)."""
        futures = self._queue(texts, owner)
        self._schedule()
        return futures

    def _queue(self, texts: list[str], owner: Hashable) -> list[asyncio.Future[np.ndarray | None]]:
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = deque()
            self._round.append(owner)
        futures: list[asyncio.Future[np.ndarray | None]] = [loop.create_future() for _ in texts]
        lane.extend(Queued(text, future, owner, next(self._order)) for text, future in zip(texts, futures, strict=True))
        self._num_queued += len(texts)
        return futures

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _schedule(self) -> None:
        if self._busy is not None and self._busy.is_closed():
            self._busy = None  # that loop ended mid-forward (a test's loop); its callback never came
        if self._busy is not None or not self._num_queued:
            return
        if self._num_queued >= self.max_batch or self._announced <= 0 or self.max_wait_s == 0:
            self._start()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._start)

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy is not None:
            return
        batch = self._take(self.max_batch)
        if not batch:  # every text queued had lost its caller
            return
        loop = self._busy = asyncio.get_running_loop()
        keys = list(dict.fromkeys((q.owner, q.text) for q in batch))
        texts = [text for _, text in keys]
        work: ThreadFuture[list[np.ndarray | None]] = self._executor.submit(self.encode_many, texts)
        work.add_done_callback(lambda w: loop.call_soon_threadsafe(self._finish, batch, keys, w))

    def _finish(self, batch: list[Queued], keys: list[tuple[Hashable, str]],
                work: ThreadFuture[list[np.ndarray | None]]) -> None:
        self._busy = None
        self.num_batches += 1
        self.num_texts += len(keys)
        cancelled = work.cancelled()  # the executor was shut down (the cache closed)
        error = None if cancelled else work.exception()
        vectors = {} if cancelled or error is not None else dict(zip(keys, work.result(), strict=True))
        for text, future, owner, _ in batch:
            if future.done():
                continue
            if cancelled:
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(vectors[owner, text])
        if self._num_queued:  # these waited through a whole forward already: no more waiting for company
            self._start()

    def _take(self, size: int) -> list[Queued]:
        """At most `size` texts whose callers are still there, one from each owner in turn (the round goes on where
        the last batch left it), oldest first within each; in the order they were queued. Costs the texts taken and
        those dropped on the way (their callers left), never the rest of the queue."""
        batch: list[Queued] = []
        while len(batch) < size and self._round:
            owner = self._round.popleft()
            lane = self._lanes[owner]
            while lane:
                queued = lane.popleft()
                self._num_queued -= 1
                if not queued.future.done():  # done: its caller left
                    batch.append(queued)
                    break
            if lane:
                self._round.append(owner)
            else:
                del self._lanes[owner]
        batch.sort(key=lambda q: q.order)
        return batch

