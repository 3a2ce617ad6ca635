"""A request must arrive whole within a deadline, or its connection is closed (slow HTTP, "Slowloris").

uvicorn times nothing out while a request is being received: its keep-alive timer runs only between requests
and is reset by every byte, and a connection that has sent part of a request has no timer at all. One client,
with no key, could open connections that send half a request line and then nothing (measured: 300 of 300 still
open after 15 s; a body sent a byte at a time, likewise), and a few thousand of them use up the file descriptors
the gateway also needs for its clients and its tiers.

Here each request, its line, headers and body, must be whole within `timeout_s` of its first chance to start:
the connection being made, or the previous response's end on a kept-alive connection. Late, the connection is
closed; a client that had begun a request and whose headers had not all come gets a 408 in OpenAI's error shape
first. Once the headers are in, the app is already waiting on the body, so a late body only closes the connection:
the app sees its client gone. The deadline ends as soon as the request is whole: a long answer stream is never
cut. This bounds what one slow client holds; a proxy in front (nginx's `client_header_timeout` and
`client_body_timeout`) is still the place for per-address connection limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("tiergate.http")
_TIMEOUT_BODY = json.dumps({"error": {
    "message": "the request did not arrive whole in time; send it again, faster", "type": "invalid_request_error",
    "param": None, "code": "request_timeout"}}).encode()
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on receiving each request (`timeout_s`, set by
    `deadline_protocol`)."""

    timeout_s = 30.0
    timed_out = 0  # connections closed for a late request, by this process (for tests and logs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._begun = False  # a byte of the current request has come

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection has the same time

    def _arm(self) -> None:
        self._disarm()
        self._begun = False
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        type(self).timed_out += 1
        headers_missing = self.cycle is None or self.cycle.response_complete
        if self._begun and headers_missing:
            self.transport.write(_TIMEOUT_RESPONSE)
        log.debug("closed a connection from %s: no whole request within %.0f s", self.client, self.timeout_s)
        self.transport.close()


def deadline_protocol(timeout_s: float) -> type[DeadlineProtocol]:
    """The protocol class to hand uvicorn's `Config(http=...)`: requests whole within `timeout_s`."""
    if timeout_s <= 0:
        raise ValueError("the request deadline must be positive")
    return type("DeadlineProtocol", (DeadlineProtocol,), {"timeout_s": float(timeout_s)})
