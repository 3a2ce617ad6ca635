"""A TCP proxy between a client and the gateway that loses answers: the first `drops` responses are read
whole from the gateway (so the gateway has finished and billed them) and never delivered; the client sees
its connection closed, as when an answer is lost on the way back, and retries."""

from __future__ import annotations

import asyncio
import threading

import h11

from tests.stubs import free_port


class DroppingProxy:
    def __init__(self, target_port: int, *, drops: int = 1) -> None:
        self.target_port = target_port
        self.drops = drops
        self.dropped = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> DroppingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        to_upstream = asyncio.ensure_future(_pipe(client_r, upstream_w))
        try:
            while True:  # one response at a time (HTTP/1.1 keep-alive: requests come one after another)
                raw, complete = await _one_response(upstream_r)
                if not raw:
                    return
                if complete and self.dropped < self.drops:
                    self.dropped += 1
                    return  # read whole, never delivered
                client_w.write(raw)
                await client_w.drain()
                if not complete:
                    return
        finally:
            to_upstream.cancel()
            client_w.close()
            upstream_w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _one_response(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """The bytes of one whole HTTP response (and True), or what came before the connection closed (False)."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # so it expects a response
    parser.send(h11.EndOfMessage())
    raw = bytearray()
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            if not data:
                return bytes(raw), False
            raw += data
            parser.receive_data(data)
        elif isinstance(event, h11.EndOfMessage):
            return bytes(raw), True
