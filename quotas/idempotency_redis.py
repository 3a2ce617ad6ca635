"""The idempotency store on Redis (`RedisIdempotency`, for replicas): each record claimed and finished by a Lua
script, so a replica that did not serve the first request replays it too, with the per-tenant bounds of
quotas/idempotency.py's `Limits` kept by the same scripts."""

from __future__ import annotations

from typing import Any

from quotas.idempotency import (
    DEFAULT_LIMITS,
    Begun,
    Claim,
    Full,
    IdempotencyStore,
    Limits,
    Mismatch,
    Running,
    _decoded,
    _encoded,
)

# Redis: per tenant, KEYS[2] a sorted set of its live keys (scored by when each expires, Redis's clock, in ms) and
# KEYS[3] a hash of their stored sizes, with their sum under '' (a key has 1 character at least); a claim drops the
# expired ones first, so only live ones count. Both live as long as their longest record.
_HELD = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function hold(ttl)
  for _, k in ipairs({KEYS[2], KEYS[3]}) do
    if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
  end
end
local function resize(member, size)
  local old = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  if size > 0 then redis.call('HSET', KEYS[3], member, size) else redis.call('HDEL', KEYS[3], member) end
  if size ~= old then redis.call('HINCRBY', KEYS[3], '', size - old) end
end
"""
_BEGIN = _HELD + """
local found = redis.call('GET', KEYS[1])
if found then
  local rec = cjson.decode(found)
  if rec.fp ~= ARGV[1] then return {'mismatch'} end
  if rec.state == 'done' then return {'replay', rec.answer} end
  return {'running'}
end
local now = now_ms()
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do resize(gone, 0) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5])
    or tonumber(redis.call('HGET', KEYS[3], '') or '0') >= tonumber(ARGV[6]) then
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  return {'full', tostring(first[2] and (tonumber(first[2]) - now) or 1000)}
end
redis.call('SET', KEYS[1], cjson.encode({state = 'running', fp = ARGV[1], owner = ARGV[2]}), 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
hold(tonumber(ARGV[3]))
return {'claim'}
"""
_FINISH = _HELD + """
local found = redis.call('GET', KEYS[1])
if found and cjson.decode(found).owner == ARGV[2] then
  redis.call('SET', KEYS[1], cjson.encode({state = 'done', fp = ARGV[1], owner = ARGV[2], answer = ARGV[3]}),
             'PX', ARGV[4])
  redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[4]), ARGV[5])
  resize(ARGV[5], tonumber(ARGV[6]))
  hold(tonumber(ARGV[4]))
end
return 1
"""
_ABANDON = _HELD + """
local found = redis.call('GET', KEYS[1])
if found then
  local rec = cjson.decode(found)
  if rec.owner == ARGV[1] and rec.state == 'running' then
    redis.call('DEL', KEYS[1])
    redis.call('ZREM', KEYS[2], ARGV[2])
    resize(ARGV[2], 0)
  end
end
return 1
"""


class RedisIdempotency(IdempotencyStore):
    def __init__(self, url: str, *, timeout_s: float = 1.0, limits: Limits = DEFAULT_LIMITS) -> None:
        import redis.asyncio as aioredis

        self.limits = limits
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._begin = self._redis.register_script(_BEGIN)
        self._finish = self._redis.register_script(_FINISH)
        self._abandon = self._redis.register_script(_ABANDON)

    @staticmethod
    def _keys(tenant: str, key: str) -> list[str]:
        """The record, the tenant's live keys and their sizes."""
        return [f"tg:idem:{tenant}:{key}", f"tg:idem-live:{tenant}", f"tg:idem-size:{tenant}"]

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        got = await self._begin(keys=self._keys(tenant, key), args=[
            fingerprint, owner, int(lease_s * 1000), key, self.limits.records, self.limits.bytes])
        kind = got[0].decode() if isinstance(got[0], bytes) else got[0]
        if kind == "claim":
            return Claim(tenant, key, fingerprint, owner)
        if kind == "replay":
            return _decoded(got[1])
        if kind == "full":
            return Full(max(1.0, float(got[1]) / 1000))
        return Mismatch() if kind == "mismatch" else Running()

    async def finish(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        text, size = _encoded(answer)
        if size > self.limits.answer_bytes:  # not kept: a retry runs again
            await self.abandon(claim)
            return
        await self._finish(keys=self._keys(claim.tenant, claim.key), args=[
            claim.fingerprint, claim.owner, text, int(ttl_s * 1000), claim.key, size])

    async def abandon(self, claim: Claim) -> None:
        await self._abandon(keys=self._keys(claim.tenant, claim.key), args=[claim.owner, claim.key])

    async def close(self) -> None:
        await self._redis.aclose()
