"""Quota state in Redis, shared by every gateway replica, exact under any concurrency.

Each request's check-and-charge is one Lua script over the keys of its tenant, so two replicas can
never both spend the last unit. All keys of a tenant share the hash tag `{<prefix>:<tenant>}`, so the
scripts also run on Redis Cluster. Sliding windows use Redis' own clock, so replicas' clocks do not
matter. Calls time out quickly (50 ms by default); failures surface as `QuotaBackendError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import QuotaBackend, QuotaBackendError
from quotas.limits import WINDOW_S, Decision, ReservationRequest, Usage, seconds_to_next_day, seconds_to_next_month

log = logging.getLogger("tiergate.quotas")

RESERVE_ATTEMPTS = 3  # each bounded by the call timeout; the script is idempotent per request id
CANCEL_ATTEMPTS = 20  # undoing a reservation whose answer was lost, once a second until Redis answers
_HERE = Path(__file__).parent
RESERVE = (_HERE / "reserve.lua").read_text()
SETTLE = (_HERE / "settle.lua").read_text()
CANCEL = (_HERE / "cancel.lua").read_text()


def _limit(v: int | None) -> int:
    return -1 if v is None else v


class RedisBackend(QuotaBackend):
    name = "redis"

    def __init__(self, url: str, *, timeout_s: float = 0.05, prefix: str = "tg", max_connections: int = 64,
                 pool_wait_s: float = 5.0) -> None:
        # a bounded pool that makes callers wait for a connection: a burst of requests queues here instead
        # of opening thousands of sockets, and is not mistaken for Redis being down
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, socket_timeout=timeout_s,
            socket_connect_timeout=max(timeout_s, 1.0), retry_on_timeout=False, health_check_interval=0)
        self.redis = aioredis.Redis(connection_pool=pool)
        self.prefix = prefix
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)
        self._cancel = self.redis.register_script(CANCEL)
        self._cancels: set[asyncio.Task[None]] = set()  # held so they are not collected before they finish

    def keys(self, req: ReservationRequest) -> list[str]:
        tag = f"{{{self.prefix}:{req.tenant}}}"
        out = []
        for lim in req.scopes:
            base = f"{tag}:{lim.scope}"
            out += [f"{base}:rpm", f"{base}:tpm", f"{base}:tpmv", f"{base}:tpmsum", f"{base}:inflight",
                    f"{base}:day:{req.day}", f"{base}:month:{req.month}"]
        return out

    async def reserve(self, req: ReservationRequest) -> Decision:
        args: list[int | str | float] = [req.request_id, req.tokens, req.money_pico, int(req.lease_s * 1000),
                                         int(WINDOW_S * 1000), len(req.scopes)]
        for lim in req.scopes:
            args += [_limit(lim.rpm), _limit(lim.tpm), _limit(lim.max_concurrent), _limit(lim.budget_day_pico),
                     _limit(lim.budget_month_pico)]
        args += [int(seconds_to_next_day(req.now)) + 1, int(seconds_to_next_month(req.now)) + 1]
        keys = self.keys(req)
        for attempt in range(RESERVE_ATTEMPTS):
            try:
                out = await self._reserve(keys=keys, args=args)
                break
            except RedisTimeout as exc:  # the script may have run: retrying with the same id is safe
                if attempt == RESERVE_ATTEMPTS - 1:
                    # the caller answers 503, so a reservation that did happen must not stay charged
                    task = asyncio.create_task(self._cancel_lost(keys, req))
                    self._cancels.add(task)
                    task.add_done_callback(self._cancels.discard)
                    raise QuotaBackendError(f"redis: {exc}", transient=True) from exc
            except RedisError as exc:
                raise QuotaBackendError(f"redis: {exc}") from exc
        if int(out[0]) == 0:
            reason = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
            return Decision(False, reason, req.scopes[int(out[2])].scope, max(0.0, int(out[3]) / 1000))
        usage = {}
        for i, lim in enumerate(req.scopes):
            nreq, tokens, reset_ms = (int(x) for x in out[1 + 3 * i: 4 + 3 * i])
            usage[lim.scope] = Usage(nreq, tokens, reset_ms / 1000, reset_ms / 1000)
        return Decision(True, usage=usage)

    async def cancel(self, req: ReservationRequest) -> None:
        """Undo `req`'s reservation (request, tokens, money, lease) if it was made; harmless if it was not."""
        try:
            await self._cancel(keys=self.keys(req), args=[req.request_id, req.money_pico])
        except RedisError as exc:
            raise QuotaBackendError(f"redis: {exc}", transient=isinstance(exc, RedisTimeout)) from exc

    async def _cancel_lost(self, keys: list[str], req: ReservationRequest) -> None:
        for _ in range(CANCEL_ATTEMPTS):
            try:
                await self._cancel(keys=keys, args=[req.request_id, req.money_pico])
                return
            except RedisError:
                await asyncio.sleep(1.0)
        log.warning("could not undo reservation %s after a timeout: it expires with its window", req.request_id)

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int) -> None:
        try:
            await self._settle(keys=self.keys(req), args=[req.request_id, tokens, money_pico - req.money_pico])
        except RedisError as exc:
            raise QuotaBackendError(f"redis: {exc}", transient=isinstance(exc, RedisTimeout)) from exc

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        t = time.gmtime(now)
        day, month = time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
        tag = f"{{{self.prefix}:{tenant}}}"
        keys = [k for scope in scopes for k in (f"{tag}:{scope}:day:{day}", f"{tag}:{scope}:month:{month}")]
        try:
            values = await self.redis.mget(keys)
        except RedisError as exc:
            raise QuotaBackendError(f"redis: {exc}", transient=isinstance(exc, RedisTimeout)) from exc
        return {scope: (int(values[2 * i] or 0), int(values[2 * i + 1] or 0)) for i, scope in enumerate(scopes)}

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except RedisError:
            return False

    async def close(self) -> None:
        if self._cancels:
            await asyncio.wait(self._cancels, timeout=2.0)
        await self.redis.aclose()
