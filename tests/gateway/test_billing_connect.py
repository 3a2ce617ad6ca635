"""A client that leaves while the gateway is still connecting to the tier pays nothing: no byte reached the tier. The
prompt is billed from the moment the request is written to the tier's connection (tests/gateway/
test_billing_prefill.py shows that side), not from the moment the gateway began to connect, which can take up to
the connect timeout (5 s) on a host that does not answer.

A connect that hangs is made the way a real one does: a listening socket whose accept queue is full, so the kernel
drops the gateway's SYNs. Until then the same socket answered the tier's health checks."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.pipeline.meter import Meter
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_billing_prefill import PROMPT, billed_settings
from tests.stubs import StubState, free_port
from tiers.client import TierClient
from tiers.errors import TierError

MODELS = b'{"object": "list", "data": [{"id": "remote", "object": "model"}]}'


class Door:
    """A loopback port that answers every HTTP request with a model list (and closes the connection: nothing is kept
    in a pool) until `close()`; from then on a connect to it hangs, as to a host that drops packets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._open = True
        self._fillers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._open:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                self.accepted += 1
                conn.settimeout(2)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(MODELS), MODELS))

    def close(self) -> None:
        """Stop accepting and fill the accept queue: a connect from now on waits for the kernel's SYN retries."""
        self._open = False
        self._thread.join()
        self.sock.listen(0)  # on a listening socket, listen() sets the queue's length anew: one connection
        while True:  # queue connections until one cannot get in
            probe = socket.socket()
            probe.settimeout(0.3)
            try:
                probe.connect(self.sock.getsockname())
            except TimeoutError:
                probe.close()
                return
            self._fillers.append(probe)
            assert len(self._fillers) < 8, "the accept queue never filled"

    def stop(self) -> None:
        self._open = False
        for s in self._fillers:
            s.close()
        self.sock.close()


@pytest.fixture
def door() -> Iterator[Door]:
    d = Door()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def gateway(tmp_path: Path, prepared_models: Path, door: Door) -> Iterator[Gateway]:
    with running_gateway(billed_settings(tmp_path, prepared_models, door.url), StubState(), plan="billed") as gw:
        yield gw


def test_a_client_that_leaves_while_the_gateway_connects_pays_nothing(gateway: Gateway, door: Door) -> None:
    door.close()  # the tier passed its health checks; its next connect hangs
    accepted = door.accepted
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gateway.url}/v1/chat/completions", timeout=0.5,
                   json={"model": "mid", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]},
                   headers={"authorization": f"Bearer {gateway.tenant_key}"})
    deadline = time.time() + 10
    while not (rows := gateway.ledger_rows()) and time.time() < deadline:
        time.sleep(0.05)
    [row] = rows
    assert door.accepted == accepted  # nothing reached the tier
    assert (row.status, row.input_tokens, row.output_tokens, row.price_usd) == ("cancelled", 0, 0, 0), row


def test_the_tier_client_says_when_the_request_is_written(door: Door) -> None:
    """`on_sent` is called once the request goes out on a connection: for the open door, not while a connect hangs
    (the call is left, as a client's leaving cancels it), nor when no connection can be made."""
    body: dict[str, Any] = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def sent_before(url: str, leave_after_s: float) -> bool:
        meter = Meter(time.perf_counter(), counted_input=5)
        client = TierClient(connect_timeout_s=5.0)
        try:
            with pytest.raises((TimeoutError, TierError)):  # the door's answer is no stream; a hang is left
                async with asyncio.timeout(leave_after_s):
                    async for _ in client.stream_chat(url, body, on_sent=meter.upstream_started):
                        pass
        finally:
            await client.aclose()
        return meter.upstream_t0 is not None

    assert asyncio.run(sent_before(door.url, 2.0))  # the door answers: the request was written
    assert not asyncio.run(sent_before(f"http://127.0.0.1:{free_port()}", 2.0))  # refused: never written
    door.close()
    assert not asyncio.run(sent_before(door.url, 0.5))  # the connect hangs: never written
