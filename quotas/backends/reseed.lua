-- Raise one tenant's money counters to the ledger's totals after Redis lost them, then mark the tenant seeded
-- (see quotas/backends/redis.py `reseed`; shared.lua is prepended). Each counter becomes max(what it holds, the
-- ledger's total): spend counted since the loss (settles whose rows the ledger already has; reserves of other
-- replicas after another re-seed) is never added twice, and a re-seed racing normal spend, or repeated by every
-- replica at once, never lowers a counter.
-- KEYS: the tenant's seeded sentinel (kept without a TTL). ARGV: 5 per scope: key base, day, month, the ledger's
--       picodollars on that day and that month
local function raise(key, total, ttl)
  if total <= 0 then return end
  local held = tonumber(redis.call('GET', key) or '0')
  if held < total then
    redis.call('SET', key, pico(total))
  end
  redis.call('EXPIRE', key, ttl)
end
for i = 1, #ARGV, 5 do
  raise(ARGV[i] .. ':day:' .. ARGV[i + 1], tonumber(ARGV[i + 3]), DAY_TTL)
  raise(ARGV[i] .. ':month:' .. ARGV[i + 2], tonumber(ARGV[i + 4]), MONTH_TTL)
end
redis.call('SET', KEYS[1], 1)
return 1
