"""Where one process stands in a shared store's change log, and how recently it caught up.

Several gateway processes share one cache store; each keeps its own faiss index and its own map of recent entries,
so each applies the others' writes and deletes from the store's change log (`CacheStore.changes_since`). The cache
catches up at most every `interval_s` (`due`), in its writer thread, never in a lookup's (cache/entry_writes.py
`sync_soon`), a few pages of the log a job (`step`), the tenants' writes queued meanwhile between them; an explicit
`catch_up` applies every page at once. While the last catch-up that worked is that recent (counted from its first
step), the cache may trust its map of recent entries (cache/recent.py), as no deletion elsewhere is older than it
and still unapplied. One that failed (the store down or locked) is tried again after `interval_s` too, but earns no
trust.

A feed made while its store does not answer (a gateway started during a Redis outage) has no cursor (`started`
False): it earns no trust, and its first catch-up, due at once, takes the cursor and answers a "reset" (the whole
index loaded from the store, as for a log cut past a cursor), in the writer thread, once the store answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cache.store import CacheStore, CacheStoreError

log = logging.getLogger(__name__)

# (op, entry id, partition): op is "put", "del", or "reset" (the log was cut past the cursor: rebuild).
Change = tuple[str, str, str]
# A catch-up's step in the writer thread applies at most PAGES_PER_JOB pages of PAGE changes: 1,000 other workers'
# puts took 10-22 ms to apply on a shared 2-core machine (SQLite; deletions about half that), so a long backlog holds
# the tenants' queued writes that long at a time, not for all of it (6,000 puts: 115 ms in one job). A "reset" (the
# log cut past the cursor: the whole index reloaded from the store) is one page, so still one job.
PAGE = 1000
PAGES_PER_JOB = 1


class ChangeFeed:
    """A cursor into the store's change log, taken when the feed is made: make it before loading the index, so
    no write in between is missed. Where the store does not answer then, the feed starts without one (`started`
    False; see the module's docstring)."""

    def __init__(self, store: CacheStore, interval_s: float):
        self.store = store
        self.interval_s = interval_s
        self.page = PAGE  # changes one read of the log returns at most
        self.pages_per_job = PAGES_PER_JOB  # pages one `step` applies at most (at least one)
        self._cursor: str | None = None  # None: none taken yet (the next catch-up takes one and reloads)
        self._last = self._tried = float("-inf")  # when the last catch-up that worked, and the last step, began
        self._began: float | None = None  # when the catch-up under way (in `step`s, not yet caught up) began
        self._lock = threading.Lock()
        try:
            self._cursor = store.change_cursor()
        except CacheStoreError as exc:
            log.warning("cache change log: no cursor (the index is loaded once the store answers): %s", exc)
        else:
            self._last = self._tried = time.monotonic()

    @property
    def started(self) -> bool:
        """Whether the feed holds a cursor: the index was loaded from the store after it was taken."""
        return self._cursor is not None

    def unstart(self) -> None:
        """Drop the cursor: the index could not be loaded after it was taken (the store stopped answering), so
        the next catch-up, due at once, takes another and loads the index then."""
        with self._lock:
            self._cursor = None
            self._last = self._tried = float("-inf")

    def recent(self) -> bool:
        """True while the last catch-up that worked began less than `interval_s` ago."""
        return time.monotonic() - self._last < self.interval_s

    def due(self) -> bool:
        """True once the last catch-up step, whether it worked or not, began `interval_s` ago or more."""
        return time.monotonic() - self._tried >= self.interval_s

    def catch_up(self, apply: Callable[[list[Change]], None], before: Callable[[], None] = lambda: None) -> int:
        """Call `apply` on every change since the cursor, in order, a page of the log at a time (so it can read
        what the page's puts need in a few batched reads), moving the cursor past each page once applied. Returns
        how many. One thread at a time: a caller waits for a step in progress (the writer thread's), then applies
        what is left (none of the changes twice). `before` runs first, under the same exclusion."""
        return self._catch_up(apply, before, None)[0]

    def step(self, apply: Callable[[list[Change]], None],
             before: Callable[[], None] = lambda: None) -> tuple[int, bool]:
        """`catch_up`, but at most `pages_per_job` pages: (changes applied, whether caught up). The writer thread
        runs a catch-up as such steps, other jobs between them (cache/entry_writes.py `sync_soon`). The catch-up
        counts as begun when its first step began (`recent`), and each step as a try (`due`); a page shorter than
        `page` (not a reset) ends it: it reached the log's end, so a catch-up of a few changes is one step, not two."""
        return self._catch_up(apply, before, max(1, self.pages_per_job))

    def _catch_up(self, apply: Callable[[list[Change]], None], before: Callable[[], None],
                  pages: int | None) -> tuple[int, bool]:
        with self._lock:
            self._tried = time.monotonic()
            if self._began is None:
                self._began = self._tried
            try:
                before()
                applied = 0
                while pages is None or pages > 0:
                    cursor, changes = self._read()
                    if not changes:
                        self._last, self._began = self._began, None
                        return applied, True
                    apply(changes)  # a "reset" (the whole index reloaded) is one page, so within one step
                    applied += len(changes)
                    self._cursor = cursor
                    if len(changes) < self.page and changes[-1][0] != "reset":  # the log's end, read after `_began`
                        self._last, self._began = self._began, None
                        return applied, True
                    if pages is not None:
                        pages -= 1
                return applied, False
            except BaseException:
                self._began = None  # the next catch-up begins anew (and earns trust from then)
                raise

    def _read(self) -> tuple[str, list[Change]]:
        """The next page of the log after the cursor; without one, a cursor taken now and a "reset": the whole
        index loaded from the store after it, so no write in between is missed."""
        if self._cursor is None:
            return self.store.change_cursor(), [("reset", "", "")]
        return self.store.changes_since(self._cursor, self.page)
