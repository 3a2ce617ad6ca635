"""What uvicorn does not bound about a client, bounded: the time it takes to send a request, the size of the
request's line and headers, and how long its answer may stay unread (slow HTTP, "Slowloris", and its mirrors).

**Sending.** uvicorn times nothing out while a request is being received: its keep-alive timer runs only between
requests and is reset by every byte, and a connection that has sent part of a request has no timer at all. One
client, with no key, could open connections that send half a request line and then nothing (measured: 300 of 300 still
open after 15 s; a body sent a byte at a time, likewise), and a few thousand of them use up the file descriptors
the gateway also needs for its clients and its tiers.

Here each request, its line, headers and body, must be whole within `timeout_s` of its first chance to start:
the connection being made, or the previous response's end on a kept-alive connection. Late, the connection is
closed; a client that had begun a request and whose headers had not all come gets a 408 in OpenAI's error shape
first. Once the headers are in, the app is already waiting on the body, so a late body only closes the connection:
the app sees its client gone. The deadline ends as soon as the request is whole: a long answer stream is never
cut.

**Size.** uvicorn's httptools parser keeps every byte of a request line and headers until they end, with no limit:
one header line of 193 MB was taken whole (a throwaway test, in 31 s, stopped only by the deadline above), so a few
connections with no key could hold gigabytes of the gateway's memory. Here a request whose line and headers pass
`max_head_bytes` (64 KiB: a key and OpenAI's headers are well under 2) gets a 431 and its connection is closed: as
the bytes come while the head has not ended, and as the parser hands over its line and headers, so a head that comes
in one read with its end (asyncio reads up to 256 KiB at a time) is refused at the header that passes the limit, its
app never run (one of 100 KB in one write was read by the app and answered 400). So does a request with more
than `max_headers` header lines (100, as Apache's `LimitRequestFields`; OpenAI's SDKs send about 15): 7,000
headers of a few bytes fit in the size limit, and the app's reading them (Litestar's headers, the key's look-up)
cost 3-4 ms a request where a plain one costs 0.2.

**Encoding.** A body is read as it is sent: a request with a `Content-Encoding` other than `identity` (a gzipped
body) gets a 415 `unsupported_content_encoding` as its headers are read, not a 400 that says its JSON is broken.

**Refusals.** How a refused request is answered and its connection closed (lingering; a request the parser
refuses; past `max_pipelined` queued requests, or behind answers still being made; past its body framing's bound):
gateway/http_refusals.py, `RefusingProtocol`, which `LimitedProtocol` extends.

**Reading.** An answer bigger than the sockets' buffers (a long stream with top log-probabilities is megabytes)
waits on its client: uvicorn pauses the app's writes until the client reads, with no limit. A tenant whose client
stops reading held the request, and with it a place in the tier's dispatch queue every tenant shares, for as long
as it liked. Here a connection whose writes stay paused with none of its answer taken for `stall_s` is reset (its
unsent bytes dropped, the kernel's too: `_reset`): the app sees its client gone, so the request is cancelled, its
upstream closed and its place freed, and it is billed for what ran, as any client that leaves.

A client that takes a few bytes within each `stall_s`, enough for the paused writes to resume (the transport's high
water mark less its low one, 64 KiB on uvloop and 48 on asyncio, within each minute would do), never stalls one write
that long, and held its request, its dispatch place and its engine seat, for as long as its answer lasted: hours, for a
stream of megabytes. So each response also has a budget of paused time: `stall_s`, and a second for every
`min_read_bytes_per_s` bytes its client took while its writes were paused (the drop of the transport's buffer from each
pause to its resume, and to each look within it: nothing else is written meanwhile, as uvicorn's send waits on the
resume). Past it the connection is reset as a stalled one is. A pause is looked at `stall_s` after it began or its
client last took bytes in it, and where the budget would run out: what was taken is credited then, so one long pause
(a whole JSON answer, or an embeddings body, is a single write) counts as many short ones do, and a client that took
nothing since the last look is reset. A client that takes its answer at the least rate or faster while the gateway
waits on it never runs out, in one pause as in many (what it takes is seen as the kernel takes it from the transport's
buffer, once its send buffer has room for a good part of itself: a client too slow to free that room within `stall_s`
reads as one that stopped); a slower one is cut after about `stall_s / (1 - its rate / the least rate)` s of waiting,
and its request holds its place for at most `stall_s` and its answer's size at the least rate, the time the app takes
to write aside. The bytes written are not what is counted: those written before the first pause fill the buffers
between the gateway and the client (a send buffer the kernel grows to 4 MB, `_reset`, and the client's receive
buffer, of its own choosing), at 2 KiB/s half an hour and more of pauses for a client that reads none of them. What
a client takes while its writes are not paused is not counted, nor is that time. The default least rate,
TIERGATE_RESPONSE_MIN_READ_BYTES_PER_S = 2 KiB/s (16 kbit/s), is below what a GPRS link delivers (20-40 kbit/s, the
slowest mobile data) and a twentieth of the slowest 3G (384 kbit/s), so a client on any real link that reads what it
is sent passes; the trickle reader above takes about 1 KB/s. The budget starts again at each response's end, as the
request deadline does.

**Connections.** A process keeps at most a number of client connections, below its open-file limit, closing the
one idle longest to make room, else the one whose request's head (then body) began longest ago and has not all come
(gateway/connection_cap.py): sockets idle, or that send part of a request and stop, cannot take the descriptors
every tenant's requests need. All open, an address holding more than its share of them makes room among its own, and
others make room among its first.

This bounds what one slow client holds; a proxy in front (nginx's `client_header_timeout`, `client_body_timeout`
and `send_timeout`) is still the place for hard per-address connection limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
from typing import Any

from gateway.connection_cap import (
    ADDRESS_SHARE,
    MAX_CONNECTIONS,
    ConnectionTable,
    connection_cap,
    peer,
    raised_fd_limit,
)
from gateway.http_refusals import FRAMING_FACTOR, RefusingProtocol
from gateway.http_responses import (
    ENCODED_RESPONSE,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    TIMEOUT_RESPONSE,
    TOO_LARGE_RESPONSE,
    TOO_MANY_RESPONSE,
)
from gateway.log_limits import access_logger, client_logger

log = logging.getLogger("tiergate.http")
CLIENT_LOG = client_logger()  # the protocol's own lines: what a client's bytes make it say
access_logger()  # access lines, if an operator turns them on, without query strings (a key sent there)
APP_LOG = logging.getLogger("uvicorn.error")  # a request cycle's: the app's errors

MIN_READ_BYTES_PER_S = 2048.0  # a paused answer's least read rate (TIERGATE_RESPONSE_MIN_READ_BYTES_PER_S): "Reading"
_LEAST_BUDGET_S = 0.01  # a paused answer's budget below this is spent: not a series of ever shorter timers to its end
_PLAIN = (b"", b"identity")  # the Content-Encoding values of a body read as it is


class LimitedProtocol(RefusingProtocol):
    """uvicorn's httptools protocol with a deadline on receiving each request (`timeout_s`), bounds on its line and
    headers (`max_head_bytes`, `max_headers`) and on a paused write (`stall_s`), set by `limited_protocol`."""

    timeout_s = 30.0
    stall_s = 60.0
    min_read_bytes_per_s = MIN_READ_BYTES_PER_S
    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    timed_out = 0  # connections closed for a late request, by this process (for tests and logs)
    stalled = 0  # connections aborted for not reading their answer (a pause past `stall_s`, or past the budget)
    client_connections = ConnectionTable(MAX_CONNECTIONS)  # this server's; `limited_protocol` gives each server its own

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = CLIENT_LOG  # what clients can make it log, a line of code at most once a minute (not errors)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None  # while the writes are paused: when the connection is reset
        self._paused_at = 0.0  # when they paused, or when their client last took bytes in the pause (the loop's time)
        self._paused_buffer = 0  # the transport's buffer then, or at the response's start if later
        self._response_at = 0.0  # when the current response's budget of paused time began (`_new_response`)
        self._paused_s = 0.0  # the current response's time with its writes paused, to `_paused_at`
        self._taken = 0  # ...and the bytes its client took during it
        self._begun = False  # a byte of the current request has come
        self._in_head = True  # the current request's line and headers have not all come
        self._head_bytes = 0  # bytes received while they had not
        self._head_parsed = 0  # bytes of the request line and headers the parser has handed over
        self._ended = False  # a request ended in the bytes being parsed
        self._in_body = False  # the current request's head is whole, its body has not all come
        self._body_bytes = 0  # bytes received since, in reads that did not end the request

    def data_received(self, data: bytes) -> None:
        if self._dropped(data):  # the parser has stopped, or a refused request's rest (`RefusingProtocol`)
            return
        # parsed first: a chunk that ends the headers is not counted as head here (it may carry the body); what the
        # parser hands over of it is (`_parsed`). Nor is one that ends a request and begins the next (pipelined):
        # most of it was the ended request's, and all of it was counted as the new head's, so a client pipelining
        # more than the limit in one write had its connection closed under it, its requests unanswered and reset
        self._ended = False
        super().data_received(data)
        if self.transport.is_closing() or self._lingering is not None or self._dropping:  # refused, or stopped
            return
        if self._in_body and not self._ended:
            self._body_bytes += len(data)
            if self._body_bytes > self.max_body_wire_bytes:
                self._body_overflow()
        if self._in_head and not self.transport.is_closing() and self._lingering is None:
            self._head_bytes += self._head_parsed if self._ended else len(data)
            if self._head_bytes > self.max_head_bytes:
                log.debug("closed a connection from %s: request head over %d bytes", self.client, self.max_head_bytes)
                self._close_refused(TOO_LARGE_RESPONSE)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._parsed(len(name) + len(value) + 4)  # ": " and CRLF
        if len(self.headers) > self.max_headers:
            self._refuse(TOO_MANY_RESPONSE)
        if name.lower() == b"content-encoding" and value.strip(b" \t").lower() not in _PLAIN:
            self._refuse(ENCODED_RESPONSE)

    def _parsed(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > self.max_head_bytes:
            self._refuse(TOO_LARGE_RESPONSE)

    def on_headers_complete(self) -> None:
        self._refuse_past_pipeline()
        self._in_head, self._in_body, self._body_bytes = False, True, 0
        if self._idle():  # its app is about to read the body: closable for room until the request is whole
            self.client_connections.receiving(self)
        self._queued_behind = self.cycle  # uvicorn's `cycle` becomes this request's, queued or not
        super().on_headers_complete()
        if self.cycle is not None:  # what the app itself logs through uvicorn (its tracebacks) is never limited
            self.cycle.logger = APP_LOG

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # its flow control (`RefusingProtocol`) first
        if not self.client_connections.opened(self, peer(self.client)):  # closed at once, as the cap closes any
            log.debug("closed a new connection from %s: %d open, none closable for it (none idle, or its address's "
                      "share taken)", self.client, self.client_connections.cap)
            transport.close()
            return
        self._arm()

    def close_for_room(self) -> None:
        """Closed, idle or its request's head unfinished, for a new connection (`ConnectionTable`)."""
        log.debug("closed a connection from %s (idle or its request's head unfinished) to make room for a new one",
                  self.client)
        self.transport.close()

    def answering(self) -> bool:
        """An answer has begun on this connection and not ended (`ConnectionTable`: never closed for room)."""
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    def connection_lost(self, exc: Exception | None) -> None:
        self.client_connections.closed(self)
        self._disarm()
        self._lingering = _cancelled(self._lingering)
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._paused_at = self.loop.time()
            self._paused_buffer = self.transport.get_write_buffer_size()
            self._time_pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:  # the response is charged the pause's last stretch, credited what was taken in it
            self._credit_pause()
            self._paused_s += self.loop.time() - max(self._paused_at, self._response_at)  # if nothing was: its time
        self._unstall()

    def _budget_s(self) -> float:
        """The paused time the current response may still take from now: its budget less the pauses it has had,
        the one going on included (its stretch since `_paused_at` not yet charged)."""
        paused = self._paused_s + self.loop.time() - max(self._paused_at, self._response_at)
        return self.stall_s + self._taken / self.min_read_bytes_per_s - paused

    def _time_pause(self) -> None:
        """(Re)time the look at the paused writes (`_stalled`): `stall_s` after the pause began or its client last
        took bytes in it, or sooner where the response's budget of paused time runs out first."""
        self._unstall()
        left = min(self.stall_s - (self.loop.time() - self._paused_at), self._budget_s())
        self._stall = self.loop.call_later(max(0.0, left), self._stalled)

    def _new_response(self) -> None:
        """The next response's budget of paused time begins (a pause going on is its from now)."""
        self._response_at, self._paused_s, self._taken = self.loop.time(), 0.0, 0
        if self._stall is not None:
            self._paused_buffer = self.transport.get_write_buffer_size()
            self._time_pause()

    def on_message_begin(self) -> None:
        self._begun, self._in_head, self._head_bytes, self._head_parsed = True, True, 0, 0
        if self._idle():  # closable for room until its head is whole; a pipelined one's connection is answering
            self.client_connections.heading(self)
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._ended, self._in_body = True, False
        if not self._idle():  # the request being answered is whole; one answered early (a 401 before its body
            self._disarm()    # came) keeps the deadline its answer's end set, or its sender could stall for ever
            self.client_connections.busy(self)  # and is never closed for room
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._new_response()  # the next response's, pipelined and begun at once or not
        if self._refused_behind():  # its refusal is said once the answers before it have all ended
            return
        cycle = self.cycle  # a pipelined request that had come whole is answered now: no deadline for it
        if not self.transport.is_closing() and (cycle is None or cycle.response_complete or cycle.more_body):
            self._arm()  # the next request on this connection has the same time
            if self._idle():
                self.client_connections.idle(self)

    def _arm(self) -> None:
        self._disarm()
        self._begun = False
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        self._deadline = _cancelled(self._deadline)

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        type(self).timed_out += 1
        if self._begun and self._idle():  # its headers had not all come: nothing else is being said to it
            self.transport.write(TIMEOUT_RESPONSE)
        log.debug("closed a connection from %s: no whole request within %.0f s", self.client, self.timeout_s)
        self.transport.close()

    def _unstall(self) -> None:
        self._stall = _cancelled(self._stall)

    def _stalled(self) -> None:
        """The pause's `stall_s` or the response's budget is up: reset, unless its client took bytes since the pause
        began or since the last look; then those are credited, the pause goes on from now as a new stretch, and the
        reset is timed anew, where the budget they leave is not spent."""
        self._stall = None
        if self.transport.is_closing() and not self.flow.write_paused:
            return
        took, left = self._credit_pause(), self._budget_s()
        if took and left >= _LEAST_BUDGET_S:
            self._time_pause()
            return
        type(self).stalled += 1
        log.debug("reset a connection from %s: %s (this answer's pauses: %.1f s, %d bytes taken in them)", self.client,
                  "its budget of paused time spent" if left < _LEAST_BUDGET_S else
                  f"none of its answer taken for {self.loop.time() - self._paused_at:.1f} s",
                  self._paused_s + self.loop.time() - max(self._paused_at, self._response_at), self._taken)
        _reset(self.transport)

    def _credit_pause(self) -> bool:
        """Charge the response the pause's stretch so far and credit it what its client took in it, the pause going
        on from now as a new stretch; whether it took any (a whole answer is one write, one pause for as long as its
        client takes to read it: credited only at the pause's end, a client reading it at any rate would be cut at
        `stall_s`)."""
        now, buffered = self.loop.time(), self.transport.get_write_buffer_size()
        if buffered >= self._paused_buffer:
            return False
        self._paused_s += now - max(self._paused_at, self._response_at)
        self._taken += self._paused_buffer - buffered
        self._paused_at, self._paused_buffer = now, buffered
        return True


_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, for 0 s: a close resets the connection


def _reset(transport: asyncio.Transport) -> None:
    """Abort `transport` and reset its connection: what the kernel still holds unsent is dropped too. An abort (uvloop's
    as asyncio's) drops only what the transport buffers and closes the socket, and a socket closed with bytes unsent
    goes on sending them, then its end: behind a client that reads nothing, the kernel kept 3.8 MB queued (a send
    buffer Linux grows to tcp_wmem's largest) in FIN-WAIT-1, outside the connection cap, for as long as the client
    kept its window shut and answered the kernel's probes (still there after 3 minutes, measured), and the client
    could read it all and then an orderly end, as if the answer had ended there."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed by the peer: nothing left to reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()


def _cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel `timer` if there is one; what the field that held it holds now (None)."""
    if timer is not None:
        timer.cancel()


def limited_protocol(timeout_s: float, stall_s: float, max_connections: int = MAX_CONNECTIONS,
                     max_body_bytes: int | None = None, address_share: float = ADDRESS_SHARE,
                     min_read_bytes_per_s: float = MIN_READ_BYTES_PER_S) -> type[LimitedProtocol]:
    """The protocol class to hand uvicorn's `Config(http=...)`: requests whole within `timeout_s`, answers read
    with no pause longer than `stall_s` and, while paused, at `min_read_bytes_per_s` or faster (a response's budget
    of paused time), at most `max_connections` open (`ConnectionTable`), an address past `address_share` of them
    making room among its own when they are all open, at most `FRAMING_FACTOR` times `max_body_bytes` (the app's
    body limit) read of a request after its head."""
    if timeout_s <= 0 or stall_s <= 0 or max_connections <= 0 or not 0 < address_share <= 1:
        raise ValueError("the request deadline, the write stall limit and the connection cap must be positive, "
                         "an address's share of the cap in (0, 1]")
    if not 0 < min_read_bytes_per_s < math.inf:  # NaN too; at an infinite one no client would earn paused time
        raise ValueError(f"the least read rate of a paused answer must be finite positive bytes/s, "
                         f"not {min_read_bytes_per_s}")
    attrs = {"timeout_s": float(timeout_s), "stall_s": float(stall_s),
             "min_read_bytes_per_s": float(min_read_bytes_per_s),
             "client_connections": ConnectionTable(max_connections, address_share)}
    if max_body_bytes is not None:
        attrs["max_body_wire_bytes"] = FRAMING_FACTOR * max_body_bytes + MAX_HEAD_BYTES
    return type("LimitedProtocol", (LimitedProtocol,), attrs)


def for_settings(settings: Any) -> type[LimitedProtocol]:
    """The protocol for a gateway's settings (`request_receipt_timeout_s`, `response_stall_timeout_s`,
    `response_min_read_bytes_per_s`, `max_connections`, `connection_share_per_address`), for a server in this process:
    its open-file limit is raised to the hard limit first, and the connection cap kept below it
    (gateway/connection_cap.py)."""
    cap = connection_cap(raised_fd_limit(), settings.max_connections)
    return limited_protocol(settings.request_receipt_timeout_s, settings.response_stall_timeout_s, cap,
                            settings.max_body_bytes, settings.connection_share_per_address,
                            settings.response_min_read_bytes_per_s)
