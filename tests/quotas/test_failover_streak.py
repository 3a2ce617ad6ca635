"""When a hung Redis counts as down: a streak of failed reserves with no success in between, whatever their
spacing. A lone client retrying once a second against a Redis that accepts connections and never answers
is served by the fallback after a few tries (HEAD: retryable 503s for as long as Redis hung), while
failures with answers in between never switch. Real redis-servers behind a proxy that can hang them."""

from __future__ import annotations

import asyncio
import contextlib
import time

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import LATE_BUDGET_S, RESERVE_ATTEMPTS, RedisBackend
from quotas.limits import Decision, ReservationRequest, ScopeLimits
from tests.conftest import RedisServer
from tests.quotas.test_failover import redis_spend

BUDGET = ScopeLimits("t", budget_day_pico=1000)
_n = iter(range(10**9))


class HangingProxy:
    """A TCP proxy in front of a redis-server. While `hung` it accepts connections and swallows what clients
    send: Redis never sees a command and no answer comes back (a hung Redis, not a refused connection)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hung = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> HangingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        pipes = [asyncio.ensure_future(self._pipe(client_r, upstream_w, hangs=True)),
                 asyncio.ensure_future(self._pipe(upstream_r, client_w, hangs=False))]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
                self._tasks.discard(task)
            client_w.close()
            upstream_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, hangs: bool) -> None:
        while data := await reader.read(65536):
            if hangs and self.hung:
                continue  # swallowed: never reaches Redis
            writer.write(data)
            await writer.drain()


def failover(url: str, **kwargs: object) -> FailoverBackend:
    """Shortened settings: a 50 ms call timeout, down after 0.5 s (and the default 3 tries) of failures."""
    return FailoverBackend(RedisBackend(url, timeout_s=0.05), down_after_s=0.5, **kwargs)  # type: ignore[arg-type]


async def reserve(b: FailoverBackend, money: int = 10) -> ReservationRequest | QuotaBackendError:
    """The request if admitted, else the error (admission refusals are not expected here)."""
    r = ReservationRequest(f"s{next(_n)}", "acme", (BUDGET,), 10, money)
    try:
        decision = await b.reserve(r)
    except QuotaBackendError as exc:
        return exc
    assert isinstance(decision, Decision) and decision.admitted
    return r


async def test_a_lone_client_retrying_once_a_second_against_a_hung_redis_is_served_by_the_fallback(
        own_redis: RedisServer) -> None:
    proxy = await HangingProxy(own_redis.port).start()
    b = failover(proxy.url, retry_every_s=1.0)
    try:
        first = await reserve(b)
        assert isinstance(first, ReservationRequest)
        await b.settle(first, tokens=1, money_pico=100)
        proxy.hung = True
        hung_at = time.monotonic()
        answers: list[ReservationRequest | QuotaBackendError] = []
        while len(answers) < 5 and b.up:
            if answers:
                await asyncio.sleep(1.0)  # a lone client's retry: further apart than down_after_s
            answers.append(await reserve(b))
        # two retryable 503s, then the third failed try in a row (>= 0.5 s of them) switches to the fallback
        assert [type(a).__name__ for a in answers] == ["QuotaBackendError"] * 2 + ["ReservationRequest"]
        assert all(a.transient for a in answers[:2] if isinstance(a, QuotaBackendError))
        assert not b.up and b.num_local_reservations == 1
        # the client's 2 s of waits, and three reserves, each of at most RESERVE_ATTEMPTS timeouts and its undo's,
        # after tries a late loop repeats for up to LATE_BUDGET_S (2.63 s here idle; the 3.0 s bound it had left
        # 0.37 s, under four late tries on a loaded CI machine)
        assert time.monotonic() - hung_at < 2.0 + 3 * (LATE_BUDGET_S + (RESERVE_ATTEMPTS + 1) * 0.05)
        local = answers[2]
        assert isinstance(local, ReservationRequest)
        await b.settle(local, tokens=1, money_pico=40)
        proxy.hung = False  # Redis answers again: back at the next try, the local spend added once
        await asyncio.sleep(1.0)
        back = await reserve(b)
        assert isinstance(back, ReservationRequest) and b.up
        await b.settle(back, tokens=1, money_pico=0)
        await b.flush_journal()
        assert await redis_spend(own_redis.url) == 100 + 40
    finally:
        proxy.hung = False
        await b.close()
        await proxy.close()


async def test_failures_with_answers_in_between_never_switch(own_redis: RedisServer) -> None:
    """Every other reserve hangs, ten in 1.5 s: five failures over far more than down_after_s, none in a row."""
    proxy = await HangingProxy(own_redis.port).start()
    b = failover(proxy.url, retry_every_s=1.0)
    try:
        for i in range(10):
            proxy.hung = i % 2 == 0
            out = await reserve(b)
            if proxy.hung:
                assert isinstance(out, QuotaBackendError) and out.transient
            else:
                assert isinstance(out, ReservationRequest)
                await b.settle(out, tokens=1, money_pico=1)
            assert b.up and b.num_local_reservations == 0
            await asyncio.sleep(0.15)
    finally:
        proxy.hung = False
        await b.close()
        await proxy.close()


async def test_a_burst_that_times_out_together_is_one_try(own_redis: RedisServer) -> None:
    """Twenty reserves that hang at once count as one failed try; two lone ones after it, far apart and with no
    answer in between, make three: down."""
    proxy = await HangingProxy(own_redis.port).start()
    b = failover(proxy.url, retry_every_s=1.0)
    try:
        assert isinstance(await reserve(b), ReservationRequest)
        proxy.hung = True
        burst = await asyncio.gather(*(reserve(b) for _ in range(20)))
        assert all(isinstance(out, QuotaBackendError) and out.transient for out in burst) and b.up
        await asyncio.sleep(0.6)
        assert isinstance(await reserve(b), QuotaBackendError) and b.up  # the second try
        await asyncio.sleep(0.6)
        assert isinstance(await reserve(b), ReservationRequest) and not b.up  # the third: the fallback admits
    finally:
        proxy.hung = False
        with contextlib.suppress(QuotaBackendError):
            await b.close()
        await proxy.close()
