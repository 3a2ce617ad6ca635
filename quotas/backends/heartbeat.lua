-- Say this replica is alive and count those that are (see quotas/backends/redis.py): a replica unheard of
-- for `stale ms` is gone. KEYS: the replicas (zset: id -> last heard ms). ARGV: this replica's id, stale ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - stale)
redis.call('PEXPIRE', KEYS[1], 2 * stale)
return redis.call('ZCARD', KEYS[1])
