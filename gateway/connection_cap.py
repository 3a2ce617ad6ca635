"""How many client connections one gateway process keeps, and which it lets go at that number.

A connection costs a file descriptor, and the process needs descriptors of its own: to its engines and remote
tiers, Redis, the ledger, model files. Without a cap, one client holding idle sockets took them all: with the
soft limit at 256, a client opening 400 connections and sending nothing left every other tenant's new
connection dropped unanswered (libuv accepts and closes what it has no descriptor for) and the fleet marked the
tiers down (their health checks failed with EMFILE), for as long as it held them (30 s a connection, the
request deadline, and again after). Most hosts start a service with a soft limit of 1,024.

So the process first raises its soft limit to the hard one (systemd's default hard limit is 524,288), then keeps
at most `cap` client connections, `FD_RESERVE` descriptors below the limit. A connection past the cap makes room
by closing the connection idle longest: one that has not sent a byte, or a kept-alive one between requests
(clients open a new one for their next request). When none is idle, it closes the one that began its request's
line and headers longest ago and has not finished them (such a request has not reached the app, nor shown a key);
when there is none of those either, the one whose request's body began longest ago and has not all come (its app
has spent nothing on it yet: it sees its client gone). Counted as busy, one client held the whole cap for every
tenant: with no key, a byte on each connection ("P", one per request deadline); with a key, a head whole and a
body that never came (probes with a cap of 20: 20 such connections, and another tenant's request got a reset).
A connection whose request is whole (being answered) is never closed for room, nor one whose app began to answer
before its body all came and has not ended (an early answer that spans an await, as one whose write is paused between
its start and its body: it was closed mid-answer); if none of the others is left, the new one is closed at once.
"""

from __future__ import annotations

import logging
import resource
from typing import Protocol

log = logging.getLogger("tiergate.http")
FD_RESERVE = 256  # descriptors kept below the limit for what the gateway opens itself (at most half of it)
MAX_CONNECTIONS = 10_000  # the default cap (TIERGATE_MAX_CONNECTIONS): each connection holds memory too
_NO_LIMIT = 1 << 20  # a limit read as "infinity" counts as this many


def raised_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, where it is lower; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return _NO_LIMIT if soft == resource.RLIM_INFINITY else soft


def connection_cap(fd_limit: int, configured: int) -> int:
    """At most `configured` connections, and `FD_RESERVE` (at most half the limit) below `fd_limit`."""
    return max(1, min(configured, fd_limit - min(FD_RESERVE, fd_limit // 2)))


class Closable(Protocol):
    def close_for_room(self) -> None: ...

    def answering(self) -> bool:
        """Whether an answer to its request has begun and not ended (never closed for room)."""
        ...


class ConnectionTable:
    """A process's open client connections, and which may be closed for room, in this order: the idle ones, oldest
    idle first; then those still sending their request's head, the one that began it first; then those still
    sending their request's body and not being answered, the one whose body began first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0
        self._idle: dict[Closable, None] = {}  # in the order they became idle
        self._heads: dict[Closable, None] = {}  # sending a request's line and headers, in the order they began
        self._bodies: dict[Closable, None] = {}  # sending a request's body, in the order their bodies began
        self.made_room = 0  # connections closed for a new one
        self.refused = 0  # new connections closed: the cap reached, none closable

    def opened(self, conn: Closable) -> bool:
        """A new connection, idle until its request begins; False when it must be closed (the cap reached and no
        connection idle or still sending its request to close in its place)."""
        self.open += 1
        if self.open > self.cap:
            while self._bodies and (first := next(iter(self._bodies))).answering():
                del self._bodies[first]  # answered before its body came: busy until that answer ends (`idle`)
            waiting = self._idle or self._heads or self._bodies
            oldest = next(iter(waiting), None)
            if oldest is None:
                self.refused += 1
                return False
            del waiting[oldest]
            self.made_room += 1
            oldest.close_for_room()
        self._idle[conn] = None
        return True

    def heading(self, conn: Closable) -> None:
        """`conn` began a request: closable for room, after every idle one, until its head is whole."""
        self._move(conn, self._heads)

    def receiving(self, conn: Closable) -> None:
        """`conn`'s request head is whole, its body is not: closable for room after every idle one and every
        unfinished head, until its request is whole (`busy`)."""
        self._move(conn, self._bodies)

    def busy(self, conn: Closable) -> None:
        """`conn`'s request is whole and being answered: never closed for room."""
        self._move(conn, None)

    def idle(self, conn: Closable) -> None:
        self._move(conn, self._idle)

    def closed(self, conn: Closable) -> None:
        self.open -= 1
        self._move(conn, None)

    def _move(self, conn: Closable, into: dict[Closable, None] | None) -> None:
        for stage in (self._idle, self._heads, self._bodies):
            stage.pop(conn, None)
        if into is not None:
            into[conn] = None
