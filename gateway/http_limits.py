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
cost 3-4 ms a request where a plain one costs 0.2. A refused request's connection closes lingering: the refusal and
then our end are sent, and the rest of the request is read and dropped (2 s and 1 MiB at most). Closed with it
unread, the connection was reset under a client still sending, which then lost the 431 (every one of 300 clients
sending a 512 KiB header in one write read a reset after it).

**Encoding.** A body is read as it is sent: a request with a `Content-Encoding` other than `identity` (a gzipped
body) gets a 415 `unsupported_content_encoding` as its headers are read, not a 400 that says its JSON is broken.

**Framing.** A request the parser refuses (not HTTP; both Content-Length and Transfer-Encoding, a second
Content-Length, a bad chunk size: the ways to smuggle a request past a proxy) gets a 400 `invalid_http_request` in
OpenAI's error shape, its connection closed lingering, nothing after it read as a request; uvicorn answered it in
plain text and closed with the rest unread.

**Pipelining.** At most `max_pipelined` (32) requests are parsed and queued behind the one being answered on a
connection; past that, the parser stops, those queued are answered, the last closing the connection. A request
refused at its head (a 431, a 415, a 400) behind answers still being made is answered after them, in order, and then
the connection closes: nothing after it is read as a request. What the client sends meanwhile is read and dropped up
to `linger_bytes`, then no more is read until the connection closes (it was read for as long as the answers took: a
client sent 256 MiB behind one held answer, all read).

**Body framing.** The app's body limit (`max_body_bytes`) counts a body's data, not its chunked framing: one
chunk's extension may go on for ever, and carries no data. A request's bytes after its head may be `FRAMING_FACTOR`
(4) times that limit (and 64 KiB of trailers); past it, it gets a 413 and its connection is closed lingering.

**Reading.** An answer bigger than the sockets' buffers (a long stream with top log-probabilities is megabytes)
waits on its client: uvicorn pauses the app's writes until the client reads, with no limit. A tenant whose client
stops reading held the request, and with it a place in the tier's dispatch queue every tenant shares, for as long
as it liked. Here a connection whose writes stay paused for `stall_s` is reset (its unsent bytes dropped, the
kernel's too: `_reset`): the app sees its client gone, so the request is cancelled, its upstream closed and its place
freed, and it is billed for what ran, as any client that leaves.

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
import json
import logging
import socket
import struct
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.connection_cap import (
    ADDRESS_SHARE,
    MAX_CONNECTIONS,
    ConnectionTable,
    connection_cap,
    peer,
    raised_fd_limit,
)
from gateway.log_limits import access_logger, client_logger
from wire.errors import MAX_BODY_BYTES

log = logging.getLogger("tiergate.http")
CLIENT_LOG = client_logger()  # the protocol's own lines: what a client's bytes make it say
access_logger()  # access lines, if an operator turns them on, without query strings (a key sent there)
APP_LOG = logging.getLogger("uvicorn.error")  # a request cycle's: the app's errors
MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers
MAX_HEADERS = 100  # a request's header lines
MAX_PIPELINED = 32  # requests queued on one connection behind the one being answered


def _error(status: bytes, message: str, code: str) -> bytes:
    """A whole HTTP response with OpenAI's error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


_TIMEOUT_RESPONSE = _error(b"408 Request Timeout", "the request did not arrive whole in time; send it again, faster",
                           "request_timeout")
_TOO_LARGE_RESPONSE = _error(b"431 Request Header Fields Too Large",
                             f"the request line and headers pass {MAX_HEAD_BYTES} bytes", "headers_too_large")
_TOO_MANY_RESPONSE = _error(b"431 Request Header Fields Too Large",
                            f"the request has more than {MAX_HEADERS} headers", "too_many_headers")
_ENCODED_RESPONSE = _error(b"415 Unsupported Media Type", "a Content-Encoding other than identity is not supported; "
                           "send the body uncompressed", "unsupported_content_encoding")
_INVALID_RESPONSE = _error(b"400 Bad Request", "the request is not valid HTTP (its line, a header, both "
                           "Content-Length and Transfer-Encoding, or its chunked framing); nothing was run",
                           "invalid_http_request")
_FRAMING_RESPONSE = _error(b"413 Request Entity Too Large", "the request body, with its chunked framing, passes "
                           "what this gateway reads of one request; send it in fewer, larger chunks",
                           "payload_too_large")
_PLAIN = (b"", b"identity")  # the Content-Encoding values of a body read as it is
FRAMING_FACTOR = 4  # a request's bytes after its head may be this many times the body limit (chunks' framing)


# `_refusal` of a request past MAX_PIPELINED: never sent; those queued are answered, then the end
_PIPELINE_FULL = b"(never sent)"


class _HeldFlow(FlowControl):
    """uvicorn's flow control, whose reading can be paused for good (`hold`): uvicorn resumes reading as each answer
    ends and as the app waits on its request's body, which would undo a plain pause."""

    held = False

    def hold(self) -> None:
        """Read nothing more from this connection (until it closes)."""
        self.held = True
        self.pause_reading()

    def resume_reading(self) -> None:
        if not self.held:
            super().resume_reading()


class _Refused(Exception):
    """Stops the parser at a header: the request is refused with `LimitedProtocol._refusal`, its app never run."""


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on receiving each request (`timeout_s`), bounds on its line and
    headers (`max_head_bytes`, `max_headers`) and on a paused write (`stall_s`), set by `limited_protocol`."""

    timeout_s = 30.0
    stall_s = 60.0
    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    max_pipelined = MAX_PIPELINED
    timed_out = 0  # connections closed for a late request, by this process (for tests and logs)
    stalled = 0  # connections aborted for not reading their answer
    max_body_wire_bytes = FRAMING_FACTOR * MAX_BODY_BYTES + MAX_HEAD_BYTES  # a request's bytes after its head
    linger_s = 2.0  # how long a refused request's rest is read and dropped before its connection is closed
    linger_bytes = 1 << 20  # ...and how much of it
    client_connections = ConnectionTable(MAX_CONNECTIONS)  # this server's; `limited_protocol` gives each server its own

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = CLIENT_LOG  # what clients can make it log, a line of code at most once a minute (not errors)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._begun = False  # a byte of the current request has come
        self._in_head = True  # the current request's line and headers have not all come
        self._head_bytes = 0  # bytes received while they had not
        self._head_parsed = 0  # bytes of the request line and headers the parser has handed over
        self._refusal: bytes | None = None  # the answer to a request refused at a header (`_refuse`)
        self._lingering: asyncio.TimerHandle | None = None  # refused, closing: when to stop reading (`_close_refused`)
        self._lingered = 0  # bytes read and dropped since, or while the refusal waits (`_dropping`)
        self._ended = False  # a request ended in the bytes being parsed
        self._dropping = False  # past MAX_PIPELINED, or refused behind an answer: what comes is dropped meanwhile
        self._in_body = False  # the current request's head is whole, its body has not all come
        self._body_bytes = 0  # bytes received since, in reads that did not end the request
        self._queued_behind: Any = None  # the request cycle before the one being read (`_drop_queued`)
        self._refused_after: bytes | None = None  # a refusal waiting on the answers before it (`_close_refused`)

    def data_received(self, data: bytes) -> None:
        if self._dropping:  # the parser has stopped (`_end_pipeline`, `_close_refused`): the answers queued go on
            self._lingered += len(data)
            if self._lingered > self.linger_bytes:  # read no more: the answers go on, the client's bytes wait
                self.flow.hold()
            return
        if self._lingering is not None:  # a refused request's rest: read and dropped (`_close_refused`)
            self._lingered += len(data)
            if self._lingered > self.linger_bytes:
                self.transport.abort()
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
                self._close_refused(_TOO_LARGE_RESPONSE)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._parsed(len(name) + len(value) + 4)  # ": " and CRLF
        if len(self.headers) > self.max_headers:
            self._refuse(_TOO_MANY_RESPONSE)
        if name.lower() == b"content-encoding" and value.strip(b" \t").lower() not in _PLAIN:
            self._refuse(_ENCODED_RESPONSE)

    def _parsed(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > self.max_head_bytes:
            self._refuse(_TOO_LARGE_RESPONSE)

    def _refuse(self, response: bytes) -> None:
        """Refuse the request being read with `response`: raised through the parser, which stops at this header
        (the app never sees the request), and answered by `send_400_response`, where uvicorn answers a parser's
        error."""
        self._refusal = response
        raise _Refused

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused (`_refuse`'s, or one that is not HTTP: uvicorn answered those in plain
        text, "Invalid HTTP request received.", and closed with the rest unread) in OpenAI's error shape, closed
        lingering. Both Content-Length and Transfer-Encoding (request smuggling's way in), a second
        Content-Length, an invalid chunk size: the parser refuses each, so nothing after it is read as a request."""
        if self._refusal is _PIPELINE_FULL:
            self._end_pipeline()
            return
        log.debug("closed a connection from %s: request refused by the parser", self.client)
        if self._refusal is None and self._drop_queued():
            return
        cycle = self.cycle
        if self._refusal is None and cycle is not None and cycle.more_body and not cycle.response_started:
            # its body's framing broke (a bad chunk) while its app waits on the body: the app sees its client gone,
            # the client the 400. A request whole (its body ended) is not the one refused: the next one's head is
            cycle.disconnected = True
            cycle.message_event.set()
            self._linger(_INVALID_RESPONSE)
            return
        self._close_refused(self._refusal or _INVALID_RESPONSE)

    def _end_pipeline(self) -> None:
        """More than `max_pipelined` requests queued behind the one being answered: uvicorn parsed all a read brought
        (256 KiB: 14,000 requests of 18 bytes, none with a key) into a request cycle each, queued, answered one by one:
        20 such connections took 620 MB and left another tenant's request waiting 12 s (a probe). Now the parser
        stops there; the requests queued are answered, the last closing the connection (a client sends the rest
        again, as after any close), and what else comes is dropped."""
        log.debug("closing a connection from %s: more than %d requests pipelined", self.client, self.max_pipelined)
        self._dropping = True
        if self.pipeline:
            self.pipeline[0][0].keep_alive = False  # the newest queued: its answer says so and closes
        elif self._idle():
            self.transport.close()
        else:
            self.cycle.keep_alive = False  # type: ignore[union-attr]

    def _drop_queued(self) -> bool:
        """Whether the request being read, its body broken (a bad chunk, its framing past the bound), was queued
        behind one being answered (pipelined): then it is dropped, unanswered, those before it are answered, the
        last closing the connection, and what else comes is dropped. Its refusal written at once went out ahead of
        the answer being made (its client read the 400 as that answer), and the end after it cut that answer."""
        if not (self.pipeline and self.pipeline[0][0] is self.cycle):
            return False
        self.pipeline.popleft()
        self.cycle = self._queued_behind  # the newest request before it: queued too, or being answered
        self._end_pipeline()
        return True

    def _body_overflow(self) -> None:
        """A request's bytes after its head passed `max_body_wire_bytes` and it has not ended: a body in chunks
        whose extensions or size lines never end, or of bytes one a chunk, or one sent after an early answer. The
        app's body limit counts only a body's data, so a client with a key sent 1.7 GB of one chunk's extension in
        3 s to an app waiting on the body, and one with none the same after its 401: parsed at a core's pace, until
        the request deadline. Its app, if waiting, sees its client gone and the client a 413; an answer sent
        already is the last; the connection closes lingering."""
        log.debug("closed a connection from %s: request body framing over %d bytes", self.client,
                  self.max_body_wire_bytes)
        if self._drop_queued():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True
            cycle.message_event.set()
            self._linger(_FRAMING_RESPONSE)
        elif self._idle():
            self._linger(b"")
        else:
            self.transport.close()

    def _close_refused(self, response: bytes) -> None:
        """Answer a request refused before its end with `response` and close the connection, lingering: the answer
        and then the end of our side are sent, and what the client still sends of its request is read and dropped,
        for at most `linger_s` and `linger_bytes`, before the connection is closed. Closed at once, with the rest of
        the request unread, the connection would be reset, and a client still sending gets a broken connection
        where it should read the refusal (nginx's `lingering_close`).

        Refused behind an answer being made (pipelined), it waits: nothing more is read as a request, the answers
        before it are sent whole, in order, then it (`on_response_complete`). Written at once, it went ahead of them
        (the client read it as their answer); closing at once cut them. Meanwhile what comes is dropped, and past
        `linger_bytes` of it no more is read (`_HeldFlow`): dropped as it came, one client kept the gateway reading
        for as long as an answer took."""
        if not self._idle():
            self._dropping, self._refused_after = True, response
            return
        self._linger(response)

    def _linger(self, response: bytes) -> None:
        """`_close_refused` once nothing else is being said on the connection."""
        self._disarm()
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = self.loop.call_later(self.linger_s, self.transport.abort)

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= self.max_pipelined:  # this one would be queued too
            self._refuse(_PIPELINE_FULL)
        self._in_head, self._in_body, self._body_bytes = False, True, 0
        if self._idle():  # its app is about to read the body: closable for room until the request is whole
            self.client_connections.receiving(self)
        self._queued_behind = self.cycle  # uvicorn's `cycle` becomes this request's, queued or not
        super().on_headers_complete()
        if self.cycle is not None:  # what the app itself logs through uvicorn (its tracebacks) is never limited
            self.cycle.logger = APP_LOG

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _HeldFlow(transport)  # before any request cycle is handed it
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
            self._stall = self.loop.call_later(self.stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

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
        if self._refused_after is not None:  # a request refused behind the answers: said once they all have ended
            if self._idle() and not self.transport.is_closing():
                self._dropping = False  # what comes now is the refused request's rest, lingered on (`_linger`)
                self._linger(self._refused_after)
            return
        cycle = self.cycle  # a pipelined request that had come whole is answered now: no deadline for it
        if not self.transport.is_closing() and (cycle is None or cycle.response_complete or cycle.more_body):
            self._arm()  # the next request on this connection has the same time
            if self._idle():
                self.client_connections.idle(self)

    def _idle(self) -> bool:
        """No answer is being made on this connection (none yet, or the last one has ended)."""
        return self.cycle is None or self.cycle.response_complete

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
            self.transport.write(_TIMEOUT_RESPONSE)
        log.debug("closed a connection from %s: no whole request within %.0f s", self.client, self.timeout_s)
        self.transport.close()

    def _unstall(self) -> None:
        self._stall = _cancelled(self._stall)

    def _stalled(self) -> None:
        self._stall = None
        if self.transport.is_closing() and not self.flow.write_paused:
            return
        type(self).stalled += 1
        log.debug("reset a connection from %s: its answer unread for %.0f s", self.client, self.stall_s)
        _reset(self.transport)


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
                     max_body_bytes: int | None = None, address_share: float = ADDRESS_SHARE) -> type[LimitedProtocol]:
    """The protocol class to hand uvicorn's `Config(http=...)`: requests whole within `timeout_s`, answers read
    with no pause longer than `stall_s`, at most `max_connections` open (`ConnectionTable`), an address past
    `address_share` of them making room among its own when they are all open, at most `FRAMING_FACTOR` times
    `max_body_bytes` (the app's body limit) read of a request after its head."""
    if timeout_s <= 0 or stall_s <= 0 or max_connections <= 0 or not 0 < address_share <= 1:
        raise ValueError("the request deadline, the write stall limit and the connection cap must be positive, "
                         "an address's share of the cap in (0, 1]")
    attrs = {"timeout_s": float(timeout_s), "stall_s": float(stall_s),
             "client_connections": ConnectionTable(max_connections, address_share)}
    if max_body_bytes is not None:
        attrs["max_body_wire_bytes"] = FRAMING_FACTOR * max_body_bytes + MAX_HEAD_BYTES
    return type("LimitedProtocol", (LimitedProtocol,), attrs)


def for_settings(settings: Any) -> type[LimitedProtocol]:
    """The protocol for a gateway's settings (`request_receipt_timeout_s`, `response_stall_timeout_s`,
    `max_connections`, `connection_share_per_address`), for a server in this process: its open-file limit is raised to
    the hard limit first, and the connection cap kept below it (gateway/connection_cap.py)."""
    cap = connection_cap(raised_fd_limit(), settings.max_connections)
    return limited_protocol(settings.request_receipt_timeout_s, settings.response_stall_timeout_s, cap,
                            settings.max_body_bytes, settings.connection_share_per_address)
