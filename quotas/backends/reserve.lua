-- Atomically check and charge every scope of one request, and hold it as a reservation with a lease
-- (see quotas/backends/redis.py; shared.lua is prepended).
-- KEYS: the reservation's record (hash), the tenant's leases (zset: request id -> lease deadline ms), then 5 per
--       scope: rpm (zset), tpm (zset), tpm values (hash), tpm sum, inflight (zset)
-- ARGV: request id, tokens, picodollars, lease ms, window ms, number of scopes, the request's arrival (epoch ms by
--       the gateway's clock, as its ledger row is dated; -1: none) and the most it may lag Redis' clock (ms): the
--       instant that dates its money is the arrival moved into [TIME - lag, TIME] (shared.lua `clock`), then 6 per
--       scope: the scope's key base (its money counters are <base>:day:<YYYYMMDD> and
--       <base>:month:<YYYYMM>) and its limits (rpm, tpm, concurrent, day, month; -1 = unlimited)
--       then the id of the attempt this one continues ('' for none: see ReservationRequest.follows in
--       quotas/limits.py): a follow-on takes no place in the rpm window (nor is refused for rpm) and takes over that
--       attempt's inflight slot where it still holds one (else it takes one as any request does); its record keeps
--       the slot taken over, which its cancel (settle.lua) puts back
--       Optionally, after the scopes' keys, the tenant's seeded sentinel (reseed.lua): where it is missing, Redis
--       lost the tenant's money counters (a restart without persistence, a failover to a lagging replica) and
--       nothing is charged until they are raised to the ledger's totals: the answer is {2, now ms}
-- Answers {1, now ms, day, month, then 5 per scope: requests, tokens, reset ms, spent today, spent this month}
--      or {0, reason, scope index, retry ms, now ms, day, month, then 2 per scope: spent today, this month}
local rid, tokens, money = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, window, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local c = clock(tonumber(ARGV[7]), tonumber(ARGV[8]))
local now, cutoff = c.now, c.now - window
local follows = ARGV[9 + 6 * n]
if follows == '' then follows = nil end
local day_keys, month_keys, spent_day, spent_month = {}, {}, {}, {}
for i = 0, n - 1 do
  local base = ARGV[9 + 6 * i]
  day_keys[i], month_keys[i] = base .. ':day:' .. c.day, base .. ':month:' .. c.month
  spent_day[i], spent_month[i] = counter(day_keys[i]), counter(month_keys[i])
end

local function refuse(reason, i, wait)
  local out = {0, reason, i, wait, now, c.day, c.month}
  for j = 0, n - 1 do
    table.insert(out, spent_day[j])
    table.insert(out, spent_month[j])
  end
  return out
end

local function admitted()
  local out = {1, now, c.day, c.month}
  for i = 0, n - 1 do
    local k = 2 + 5 * i
    local oldest = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
    table.insert(out, redis.call('ZCARD', KEYS[k + 1]))
    table.insert(out, counter(KEYS[k + 4]))
    table.insert(out, tonumber(oldest[2] or now) + window - now)
    table.insert(out, spent_day[i])
    table.insert(out, spent_month[i])
  end
  return out
end

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

-- the same request retried after a timeout (the first attempt may have run): answer, do not charge twice;
-- one already settled, reaped or cancelled (a reserve that arrived after its own cancel) is charged nothing
local state = redis.call('HGET', KEYS[1], 'st')
if state == 'r' then return admitted() end
if state then return refuse('duplicate', 0, 0) end
local sentinel = KEYS[3 + 5 * n]
if sentinel and redis.call('EXISTS', sentinel) == 0 then return {2, now} end

for i = 0, n - 1 do
  local k = 2 + 5 * i
  local a = 10 + 6 * i
  local rpm, tpm, conc = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local day, month = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  expire(k)
  local nreq = redis.call('ZCARD', KEYS[k + 1])
  if rpm >= 0 and not follows and nreq + 1 > rpm then
    local oldest = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
    local wait = window
    if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
    return refuse('rpm', i, wait)
  end
  local sum = counter(KEYS[k + 4])
  if tpm >= 0 and sum + tokens > tpm then
    local excess, wait = sum + tokens - tpm, window
    local entries = redis.call('ZRANGE', KEYS[k + 2], 0, -1, 'WITHSCORES')
    for j = 1, #entries, 2 do
      excess = excess - tonumber(redis.call('HGET', KEYS[k + 3], entries[j]) or '0')
      if excess <= 0 then wait = tonumber(entries[j + 1]) + window - now; break end
    end
    return refuse('tpm', i, wait)
  end
  local slot = 1
  if follows and redis.call('ZSCORE', KEYS[k + 5], follows) then slot = 0 end  -- a slot taken over is no new one
  if conc >= 0 and redis.call('ZCARD', KEYS[k + 5]) + slot > conc then
    return refuse('concurrency', i, 1000)
  end
  -- the budget's period is the dated instant's, which may have ended (an arrival before midnight): no wait then
  if day >= 0 and spent_day[i] + money > day then
    return refuse('budget_day', i, math.max(0, c.next_day - now))
  end
  if month >= 0 and spent_month[i] + money > month then
    return refuse('budget_month', i, math.max(0, c.next_month - now))
  end
  -- a counter this would raise past COUNTER_MAX (shared.lua) refuses it before anything is written (a scope without
  -- a limit too): its INCRBY would fail after the slots taken and the day charged, with no record to return them.
  -- Its own reasons (quotas/backends/base.py COUNTER_MAX): no budget is spent, nor a rate limit reached
  if not fits(sum, tokens) then return refuse('overflow_tpm', i, window) end
  if money > 0 and not fits(spent_day[i], money) then
    return refuse('overflow_day', i, math.max(0, c.next_day - now))
  end
  if money > 0 and not fits(spent_month[i], money) then
    return refuse('overflow_month', i, math.max(0, c.next_month - now))
  end
end

local record = {'st', 'r', 'tok', tokens, 'pico', pico(money), 'day', c.day, 'month', c.month, 'n', n}
-- a slot taken over is written in the record (`f`, the attempt followed, and `fs<scope>`, its slot's lease there),
-- so that a cancel of this one (its answer was lost: nothing took it over) gives that attempt its slot back
if follows then
  table.insert(record, 'f')
  table.insert(record, follows)
end
for i = 0, n - 1 do
  local k = 2 + 5 * i
  if follows then
    local held = redis.call('ZSCORE', KEYS[k + 5], follows)
    if held then
      redis.call('ZREM', KEYS[k + 5], follows)
      table.insert(record, 'fs' .. (i + 1))
      table.insert(record, held)
    end
  else
    redis.call('ZADD', KEYS[k + 1], now, rid)
  end
  redis.call('ZADD', KEYS[k + 2], now, rid)
  redis.call('HSET', KEYS[k + 3], rid, tokens)
  redis.call('INCRBY', KEYS[k + 4], tokens)
  redis.call('ZADD', KEYS[k + 5], now + lease, rid)
  for j = 1, 5 do redis.call('PEXPIRE', KEYS[k + j], window + lease + 1000) end
  spent_day[i] = spent_day[i] + money
  spent_month[i] = spent_month[i] + money
  if money ~= 0 then
    redis.call('INCRBY', day_keys[i], pico(money))
    redis.call('INCRBY', month_keys[i], pico(money))
  end
  redis.call('EXPIRE', day_keys[i], DAY_TTL)
  redis.call('EXPIRE', month_keys[i], MONTH_TTL)
  table.insert(record, 'b' .. (i + 1))
  table.insert(record, ARGV[9 + 6 * i])
end
-- the record lives until it is settled or reaped: the money it holds is returned only through it
redis.call('HSET', KEYS[1], unpack(record))
redis.call('ZADD', KEYS[2], now + lease, rid)
return admitted()
