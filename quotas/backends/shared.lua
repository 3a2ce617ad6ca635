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

-- add `delta` to a money counter and keep it `ttl` seconds; a refund to a counter that is gone (its period
-- ended long ago, or Redis lost it) is dropped rather than leaving a negative counter behind
local function add_money(key, delta, ttl)
  if delta == 0 or (delta < 0 and redis.call('EXISTS', key) == 0) then return end
  redis.call('INCRBY', key, pico(delta))
  redis.call('EXPIRE', key, ttl)
end

