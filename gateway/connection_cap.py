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

**Per address.** The table being full, which connection made room depended on nothing but age, so one peer address
that opened the whole cap (sockets idle, or a byte of a request each) and kept opening had every other client's idle
or unfinished connection closed in turn for its new ones (a test with a cap of 16: another address's kept-alive
connections, idle longest, were closed for 48 idle sockets of one). So a full table counts addresses: one holding
more than `share` of the cap (half, by default) makes room for its new connections only among its own, and a new one
of its is closed at once, as the cap closes any, when none of its own may be closed; a new connection from any other
address makes room among the connections of the address holding most, past its share, before anyone else's (by age
alone when none of those may be closed). Nothing changes while the table has room, so one address may hold the whole
cap while nobody else wants a place; nor with one address: behind a proxy or load balancer every connection is the
proxy's, and its new ones make room among its own, as before. Beside a few other addresses, a proxy is refused only
when the table is full, it holds more than half of it and every one of its connections is being answered, where by
age alone it closed the others' connections. An IPv6 address counts by its /64, the block one host is given (`peer`).
"""

from __future__ import annotations

import ipaddress
import logging
import resource
from typing import Protocol

log = logging.getLogger("tiergate.http")
FD_RESERVE = 256  # descriptors kept below the limit for what the gateway opens itself (at most half of it)
MAX_CONNECTIONS = 10_000  # the default cap (TIERGATE_MAX_CONNECTIONS): each connection holds memory too
ADDRESS_SHARE = 0.5  # the default share of the cap one address keeps when the table is full
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


def peer(client: tuple[str, int] | None) -> str:
    """The address a connection from `client` (uvicorn's (host, port), None for a Unix socket) counts against: its host,
    an IPv4-mapped IPv6 one as IPv4, any other IPv6 one as its /64."""
    if client is None:
        return ""
    host = client[0]
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class Closable(Protocol):
    def close_for_room(self) -> None: ...

    def answering(self) -> bool:
        """Whether an answer to its request has begun and not ended (never closed for room)."""
        ...


_IDLE, _HEADS, _BODIES = 0, 1, 2  # a connection's stage; the stages are closed for room in this order
_Stages = tuple[dict[Closable, None], dict[Closable, None], dict[Closable, None]]  # each in the order entered


class ConnectionTable:
    """A process's open client connections, and which may be closed for room, in this order: the idle ones, oldest
    idle first; then those still sending their request's head, the one that began it first; then those still
    sending their request's body and not being answered, the one whose body began first. The table being full, an
    address past its `share` of the cap makes room only among its own; another makes room among the connections of
    the address holding most, past its share, first."""

    def __init__(self, cap: int, share: float = ADDRESS_SHARE) -> None:
        self.cap = cap
        self.max_per_address = max(1, int(cap * share))  # past it, a full table's room is made among one's own
        self.open = 0
        self._stages: _Stages = ({}, {}, {})  # every address's
        self._own: dict[str, _Stages] = {}  # each address's
        self._address: dict[Closable, str] = {}
        self._held: dict[str, int] = {}  # open connections, by address
        self._crowded: set[str] = set()  # addresses holding more than `max_per_address`
        self.made_room = 0  # connections closed for a new one
        self.refused = 0  # new connections closed: the cap reached, none closable
        self.refused_for_address = 0  # ...of which: from an address past its share, none of its own closable

    def opened(self, conn: Closable, address: str = "") -> bool:
        """A new connection from `address` (`peer`), idle until its request begins; False when it must be closed (the
        cap reached and no connection idle or still sending its request to close in its place, among its address's
        own where that address holds more than its share)."""
        self.open += 1
        self._address[conn] = address
        held = self._held[address] = self._held.get(address, 0) + 1
        if held == 1:
            self._own[address] = ({}, {}, {})
        elif held > self.max_per_address:
            self._crowded.add(address)
        if self.open > self.cap:
            crowded = held > self.max_per_address
            oldest = self._oldest([self._own[address]] if crowded else self._room_order())
            if oldest is None:
                self.refused += 1
                if crowded and self._oldest([self._stages]) is not None:  # another address's could have been
                    self.refused_for_address += 1
                return False
            self._move(oldest, None)
            self.made_room += 1
            oldest.close_for_room()
        self._move(conn, _IDLE)
        return True

    def heading(self, conn: Closable) -> None:
        """`conn` began a request: closable for room, after every idle one, until its head is whole."""
        self._move(conn, _HEADS)

    def receiving(self, conn: Closable) -> None:
        """`conn`'s request head is whole, its body is not: closable for room after every idle one and every
        unfinished head, until its request is whole (`busy`)."""
        self._move(conn, _BODIES)

    def busy(self, conn: Closable) -> None:
        """`conn`'s request is whole and being answered: never closed for room."""
        self._move(conn, None)

    def idle(self, conn: Closable) -> None:
        self._move(conn, _IDLE)

    def closed(self, conn: Closable) -> None:
        self.open -= 1
        self._move(conn, None)
        address = self._address.pop(conn)
        held = self._held[address] = self._held[address] - 1
        if held <= self.max_per_address:
            self._crowded.discard(address)
        if not held:
            del self._held[address], self._own[address]

    def _room_order(self) -> list[_Stages]:
        """Where a new connection from an address within its share makes room: among the crowded addresses'
        connections, the one holding most first, then among every address's."""
        crowded = sorted(self._crowded, key=self._held.__getitem__, reverse=True)
        return [*(self._own[address] for address in crowded), self._stages]

    def _oldest(self, candidates: list[_Stages]) -> Closable | None:
        """The first connection that may be closed for room, in the first of `candidates` that has one."""
        for stages in candidates:
            bodies = stages[_BODIES]
            while bodies and (first := next(iter(bodies))).answering():
                self._move(first, None)  # answered before its body came: busy until that answer ends (`idle`)
            for stage in stages:
                if stage:
                    return next(iter(stage))
        return None

    def _move(self, conn: Closable, into: int | None) -> None:
        address = self._address.get(conn)
        if address is None:  # closed already
            return
        for stages in (self._stages, self._own[address]):
            for stage in stages:
                stage.pop(conn, None)
            if into is not None:
                stages[into][conn] = None
