"""A TCP proxy in front of the tests' PostgreSQL that loses a reply or takes the database away (`PgProxy`), and its
fixture, `pg_proxy` (a plugin of tests/conftest.py: every test's)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from tests.postgres import PostgresServer
from tests.stubs import free_port


class PgProxy:
    """A TCP proxy in front of PostgreSQL that loses a reply: with `lose` set, the first statement whose text holds it
    goes to the server, which runs and commits it (it replies only then), and the connection is cut as the reply
    comes, so the client never hears. With `then_down` the database is unreachable after that (every connection cut,
    new ones closed at once) until `up()`. With `count` set, `counted` is how many statements holding it were sent."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.port = free_port()
        self.lose: bytes | None = None
        self.then_down = False
        self.lost = 0
        self.count: bytes | None = None
        self.counted = 0
        self.refusing = False
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._listener: asyncio.base_events.Server | None = None

    def url(self, database_url: str) -> str:
        return database_url.replace(f":{self.server.port}/", f":{self.port}/")

    def start(self) -> PgProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def up(self) -> None:
        self.refusing = False

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        self._listener = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def _cut_all(self) -> None:
        for writer in list(self._open):
            writer.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_w.close()
            return
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.server.port)
        self._open |= {client_w, server_w}
        marked = asyncio.Event()

        async def to_server() -> None:
            while data := await client_r.read(65536):
                if self.count is not None and self.count in data:
                    self.counted += 1
                if self.lose is not None and self.lose in data:
                    self.lose = None
                    marked.set()
                server_w.write(data)
                await server_w.drain()

        async def to_client() -> None:
            while data := await server_r.read(65536):
                if marked.is_set():  # the statement ran and committed: its reply is lost
                    self.lost += 1
                    if self.then_down:
                        self.refusing = True
                        self._cut_all()
                    return
                client_w.write(data)
                await client_w.drain()

        pumps = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (client_w, server_w):
                self._open.discard(writer)
                writer.close()


@pytest.fixture
def pg_proxy(postgres_server: PostgresServer) -> Iterator[PgProxy]:
    proxy = PgProxy(postgres_server).start()
    yield proxy
    proxy.stop()
