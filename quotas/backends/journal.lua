-- Add one batch of money settled locally during an outage to the shared counters, once (see
-- quotas/backends/failover.py; shared.lua is prepended). The batch's marker says it was applied: a batch sent
-- again (its answer was lost) changes nothing.
-- KEYS: the batch's marker. ARGV: marker ttl s, then 4 per entry: key base, day, month, picodollars.
-- The marker is the last write: Redis keeps a script's writes made before an error, so one set first would leave a
-- batch whose apply failed marked as applied, its money never counted (a retry may count what applied twice instead:
-- an early refusal, never overspend).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 4 do
  local money = tonumber(ARGV[i + 3])
  add_money(ARGV[i] .. ':day:' .. ARGV[i + 1], money, DAY_TTL)
  add_money(ARGV[i] .. ':month:' .. ARGV[i + 2], money, MONTH_TTL)
end
redis.call('SET', KEYS[1], 1, 'EX', tonumber(ARGV[1]))
return 1
