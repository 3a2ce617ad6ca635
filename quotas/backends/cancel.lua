-- Undo one request's reservation entirely, as if it had never been admitted (see quotas/backends/redis.py).
-- Used when a reserve call timed out on the gateway's side although the script may have run: the gateway
-- answers 503 and the tenant must not pay a request, tokens, money or a concurrency slot for it.
-- KEYS: the same 7 per scope as reserve.lua. ARGV: request id, reserved picodollars. Idempotent.
local rid, money = ARGV[1], tonumber(ARGV[2])
for k = 0, #KEYS - 1, 7 do
  if redis.call('ZREM', KEYS[k + 1], rid) == 1 then
    local tokens = redis.call('HGET', KEYS[k + 3], rid)
    if tokens then
      redis.call('DECRBY', KEYS[k + 4], tonumber(tokens))
      redis.call('HDEL', KEYS[k + 3], rid)
    end
    redis.call('ZREM', KEYS[k + 2], rid)
    redis.call('ZREM', KEYS[k + 5], rid)
    if money ~= 0 then
      redis.call('DECRBY', KEYS[k + 6], money)
      redis.call('DECRBY', KEYS[k + 7], money)
    end
  end
end
return 1
