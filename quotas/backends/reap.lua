-- Claim a tenant's reservations whose lease ran out (see quotas/backends/redis.py). A claimed id's lease moves
-- `claim ms` ahead, so replicas reaping at once each get different ids, and the ids of a reaper that died
-- before finishing them come back after the claim; finishing (settle.lua, kind 'reap') is idempotent anyway.
-- KEYS: the tenant's leases. ARGV: claim ms, most ids to claim. Answers the claimed request ids.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id) end
return ids
