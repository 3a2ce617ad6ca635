-- Replace one request's reservation by its real usage (see quotas/backends/redis.py).
-- KEYS: the same 7 per scope as reserve.lua. ARGV: request id, real tokens, money delta (real - reserved).
local rid, tokens, delta = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for k = 0, #KEYS - 1, 7 do
  local old = redis.call('HGET', KEYS[k + 3], rid)
  if old then
    redis.call('HSET', KEYS[k + 3], rid, tokens)
    redis.call('INCRBY', KEYS[k + 4], tokens - tonumber(old))
  end
  redis.call('ZREM', KEYS[k + 5], rid)
  if delta ~= 0 then
    redis.call('INCRBY', KEYS[k + 6], delta)
    redis.call('INCRBY', KEYS[k + 7], delta)
  end
end
return 1
