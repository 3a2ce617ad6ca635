-- What the money scripts share, prepended to each (see quotas/backends/redis.py): one clock for every replica,
-- Redis' own TIME, which bounds the instant that dates a request's money (its arrival, at most a small lag before
-- TIME and never after it), so no gateway's clock decides a budget's day; and the one way a money counter changes.
-- Civil dates from day numbers as in Howard Hinnant's `civil_from_days` / `days_from_civil`.
local DAY_TTL, MONTH_TTL = 2 * 86400, 32 * 86400  -- seconds a day's and a month's counter outlive their last write

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

-- the day (YYYYMMDD) and month (YYYYMM) of a day number since the epoch, and the ms at which the next day and
-- the next month begin
local function dates(days)
  local y, m, d = civil_from_days(days)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return {day = string.format('%04d%02d%02d', y, m, d), month = string.format('%04d%02d', y, m),
          next_day = (days + 1) * 86400000, next_month = days_from_civil(ny, nm, 1) * 86400000}
end

-- Redis' own clock: `now` (ms), and the `dates` of the instant that dates a request's money: its arrival `at`
-- (ms, the gateway's clock) moved into [now - lag, now] (quotas/limits.py MAX_DATING_LAG_S), so no
-- gateway's clock moves money by more than `lag`; now, where no arrival is given (nil or negative)
local function clock(at, lag)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local dated = now
  if at ~= nil and at >= 0 then dated = math.min(now, math.max(now - lag, at)) end
  local c = dates(math.floor(dated / 86400000))
  c.now = now
  return c
end

-- a whole number of picodollars as Redis must be handed it: its digits. Redis writes a Lua number with 17
-- significant digits, so 1.2e17 ($120,000) went as '1.2e+17', which INCRBY refuses and which, SET, left a counter
-- no later INCRBY could add to. (A double holds picodollars exactly to 2**53, $9,007; past it, to 1024 of them.)
local function pico(n)
  return string.format('%d', n)
end

-- The most a counter is meant to hold. Redis' counters are int64: an INCRBY past 2**63 - 1 fails mid-script, after
-- the writes before it (a reserve's slots taken, its day charged, its record never written). A script checks every
-- increment against this before its first write (`fits`), on the Lua numbers (doubles) it reads counters as: 4,096
-- below 2**63, it covers their rounding (512 at most each, near 2**63) and is itself exact. (A tenant with no
-- budget reaches it at $9.2M spent on a scope in a month.)
local COUNTER_MAX = 2 ^ 63 - 4096

-- a counter's value as a Lua number (0 where it is missing), never above COUNTER_MAX: Redis turns a Lua number
-- past 2**63 into a negative integer in an answer
local function counter(key)
  return math.min(tonumber(redis.call('GET', key) or '0'), COUNTER_MAX)
end

-- whether `delta` can be added to a counter holding `held` (as `counter` reads it) without passing int64's end. Not
-- `held + delta <= COUNTER_MAX`: near 2**63 that sum rounds to a multiple of 1,024 (COUNTER_MAX + 100 is
-- COUNTER_MAX); the gap, COUNTER_MAX - held, is exact there
local function fits(held, delta)
  return delta <= COUNTER_MAX - held
end

-- add `delta` to a counter; a sum past COUNTER_MAX leaves it at COUNTER_MAX (every budget refuses it) rather than
-- failing the script halfway: a settle, a journal batch or row applies whole
local function add_capped(key, delta)
  if delta > 0 and not fits(counter(key), delta) then
    redis.call('SET', key, pico(COUNTER_MAX), 'KEEPTTL')
  else
    redis.call('INCRBY', key, pico(delta))
  end
end

-- add `delta` to a money counter (`add_capped`) and keep it `ttl` seconds; a refund to a counter that is gone (its
-- period ended long ago, or Redis lost it) is dropped rather than leaving a negative counter behind
local function add_money(key, delta, ttl)
  if delta == 0 or (delta < 0 and redis.call('EXISTS', key) == 0) then return end
  add_capped(key, delta)
  redis.call('EXPIRE', key, ttl)
end
