-- Atomically check and charge every scope of one request (see quotas/backends/redis.py).
-- KEYS: 7 per scope: rpm (zset), tpm (zset), tpm values (hash), tpm sum, inflight (zset), day, month
-- ARGV: request id, tokens, picodollars, lease ms, window ms, number of scopes,
--       then 5 limits per scope (rpm, tpm, concurrent, day, month; -1 = unlimited), then day/month reset s
local rid, tokens, money = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, window, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local reset_day, reset_month = tonumber(ARGV[7 + 5 * n]), tonumber(ARGV[8 + 5 * n])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window

local function expire(k)
  local old = redis.call('ZRANGEBYSCORE', KEYS[k + 2], '-inf', cutoff)
  if #old > 0 then
    local freed = 0
    for _, id in ipairs(old) do
      freed = freed + tonumber(redis.call('HGET', KEYS[k + 3], id) or '0')
      redis.call('HDEL', KEYS[k + 3], id)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', cutoff)
    redis.call('DECRBY', KEYS[k + 4], freed)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 1], '-inf', cutoff)
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 5], '-inf', now)
end

-- the same request retried after a timeout (the first attempt may have run): answer, do not charge twice
if n > 0 and redis.call('ZSCORE', KEYS[5], rid) then
  local out = {1}
  for i = 0, n - 1 do
    local k = 7 * i
    local oldest_req = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
    table.insert(out, redis.call('ZCARD', KEYS[k + 1]))
    table.insert(out, tonumber(redis.call('GET', KEYS[k + 4]) or '0'))
    table.insert(out, tonumber(oldest_req[2] or now) + window - now)
  end
  return out
end

for i = 0, n - 1 do
  local k = 7 * i
  local a = 7 + 5 * i
  local rpm, tpm, conc = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local day, month = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  expire(k)
  local nreq = redis.call('ZCARD', KEYS[k + 1])
  if rpm >= 0 and nreq + 1 > rpm then
    local oldest = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
    local wait = window
    if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
    return {0, 'rpm', i, wait}
  end
  local sum = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
  if tpm >= 0 and sum + tokens > tpm then
    local excess, wait = sum + tokens - tpm, window
    local entries = redis.call('ZRANGE', KEYS[k + 2], 0, -1, 'WITHSCORES')
    for j = 1, #entries, 2 do
      excess = excess - tonumber(redis.call('HGET', KEYS[k + 3], entries[j]) or '0')
      if excess <= 0 then wait = tonumber(entries[j + 1]) + window - now; break end
    end
    return {0, 'tpm', i, wait}
  end
  if conc >= 0 and redis.call('ZCARD', KEYS[k + 5]) + 1 > conc then
    return {0, 'concurrency', i, 1000}
  end
  if day >= 0 and tonumber(redis.call('GET', KEYS[k + 6]) or '0') + money > day then
    return {0, 'budget_day', i, reset_day * 1000}
  end
  if month >= 0 and tonumber(redis.call('GET', KEYS[k + 7]) or '0') + money > month then
    return {0, 'budget_month', i, reset_month * 1000}
  end
end

local out = {1}
for i = 0, n - 1 do
  local k = 7 * i
  redis.call('ZADD', KEYS[k + 1], now, rid)
  redis.call('ZADD', KEYS[k + 2], now, rid)
  redis.call('HSET', KEYS[k + 3], rid, tokens)
  local sum = redis.call('INCRBY', KEYS[k + 4], tokens)
  redis.call('ZADD', KEYS[k + 5], now + lease, rid)
  redis.call('INCRBY', KEYS[k + 6], money)
  redis.call('INCRBY', KEYS[k + 7], money)
  for j = 1, 5 do redis.call('PEXPIRE', KEYS[k + j], window + lease + 1000) end
  redis.call('EXPIRE', KEYS[k + 6], 2 * 86400)
  redis.call('EXPIRE', KEYS[k + 7], 32 * 86400)
  local oldest_req = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
  table.insert(out, redis.call('ZCARD', KEYS[k + 1]))
  table.insert(out, sum)
  table.insert(out, tonumber(oldest_req[2]) + window - now)
end
return out
