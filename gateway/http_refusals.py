"""How the gateway's HTTP protocol (gateway/http_limits.py) refuses a request and closes its connection: in
OpenAI's error shape, lingering, in order behind the answers before it.

**Lingering.** A refused request's connection closes lingering: the refusal and then our end are sent, and the rest
of the request is read and dropped (2 s and 1 MiB at most). Closed with it unread, the connection was reset under a
client still sending, which then lost the 431 (every one of 300 clients sending a 512 KiB header in one write read a
reset after it).

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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http_flow import HeldFlow
from gateway.http_responses import FRAMING_RESPONSE, INVALID_RESPONSE, MAX_HEAD_BYTES
from wire.errors import MAX_BODY_BYTES

log = logging.getLogger("tiergate.http")
MAX_PIPELINED = 32  # requests queued on one connection behind the one being answered
FRAMING_FACTOR = 4  # a request's bytes after its head may be this many times the body limit (chunks' framing)


# `_refusal` of a request past MAX_PIPELINED: never sent; those queued are answered, then the end
_PIPELINE_FULL = b"(never sent)"


class _Refused(Exception):
    """Stops the parser at a header: the request is refused with `RefusingProtocol._refusal`, its app never run."""


class RefusingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that refuses a request (`_refuse`, `_close_refused`) in order behind the answers
    before it, stops parsing past `max_pipelined` queued requests, and closes a refused request's connection
    lingering; what refuses a request is `LimitedProtocol`'s (gateway/http_limits.py)."""

    flow: HeldFlow
    max_pipelined = MAX_PIPELINED
    max_body_wire_bytes = FRAMING_FACTOR * MAX_BODY_BYTES + MAX_HEAD_BYTES  # a request's bytes after its head
    linger_s = 2.0  # how long a refused request's rest is read and dropped before its connection is closed
    linger_bytes = 1 << 20  # ...and how much of it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refusal: bytes | None = None  # the answer to a request refused at a header (`_refuse`)
        self._lingering: asyncio.TimerHandle | None = None  # refused, closing: when to stop reading (`_close_refused`)
        self._lingered = 0  # bytes read and dropped since, or while the refusal waits (`_dropping`)
        self._dropping = False  # past MAX_PIPELINED, or refused behind an answer: what comes is dropped meanwhile
        self._queued_behind: Any = None  # the request cycle before the one being read (`_drop_queued`)
        self._refused_after: bytes | None = None  # a refusal waiting on the answers before it (`_close_refused`)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = HeldFlow(transport)  # before any request cycle is handed it

    def _dropped(self, data: bytes) -> bool:
        """Whether `data`, just received, is read and dropped rather than parsed: the parser has stopped, or a
        refused request's rest is lingered on."""
        if self._dropping:  # the parser has stopped (`_end_pipeline`, `_close_refused`): the answers queued go on
            self._lingered += len(data)
            if self._lingered > self.linger_bytes:  # read no more: the answers go on, the client's bytes wait
                self.flow.hold()
            return True
        if self._lingering is not None:  # a refused request's rest: read and dropped (`_close_refused`)
            self._lingered += len(data)
            if self._lingered > self.linger_bytes:
                self.transport.abort()
            return True
        return False

    def _refuse_past_pipeline(self) -> None:
        """At a request's headers: if it would be queued past `max_pipelined`, the parser stops there
        (`_end_pipeline`)."""
        if len(self.pipeline) >= self.max_pipelined:  # this one would be queued too
            self._refuse(_PIPELINE_FULL)

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
            self._linger(INVALID_RESPONSE)
            return
        self._close_refused(self._refusal or INVALID_RESPONSE)

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
            self._linger(FRAMING_RESPONSE)
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
        before it are sent whole, in order, then it (`_refused_behind`). Written at once, it went ahead of them
        (the client read it as their answer); closing at once cut them. Meanwhile what comes is dropped, and past
        `linger_bytes` of it no more is read (`HeldFlow`): dropped as it came, one client kept the gateway reading
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

    def _refused_behind(self) -> bool:
        """At an answer's end: whether a request was refused behind the answers (`_close_refused`); its refusal is
        said once they all have ended."""
        if self._refused_after is None:
            return False
        if self._idle() and not self.transport.is_closing():
            self._dropping = False  # what comes now is the refused request's rest, lingered on (`_linger`)
            self._linger(self._refused_after)
        return True

    def _idle(self) -> bool:
        """No answer is being made on this connection (none yet, or the last one has ended)."""
        return self.cycle is None or self.cycle.response_complete

    def _disarm(self) -> None:
        """Stop the current request's deadline as its refusal is said: none here (`LimitedProtocol` has one)."""
