-- Claim a tenant's reservations whose lease ran out (see quotas/backends/redis.py). A claimed id's lease moves
-- `claim ms` ahead, so replicas reaping at once each get different ids, and the ids of a reaper that died
-- before finishing them come back after the claim; finishing (settle.lua, kind 'reap') is idempotent anyway.
-- The claim's deadline goes to settle.lua (kind 'reap'), which leaves a lease pushed past it (its owner renewed it
-- after the claim: the request is alive) to its owner.
-- KEYS: the tenant's leases. ARGV: claim ms, most ids to claim. Answers the claim's deadline (ms, Redis' clock),
-- then the claimed request ids.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[1])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], deadline, id) end
table.insert(ids, 1, deadline)
return ids
