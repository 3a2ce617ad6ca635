-- Add the money of ledger rows settled on a replica's fallback during an outage to the shared counters, each row
-- once, whichever replica sends it and however often (see quotas/backends/failover.py; shared.lua is prepended).
-- A row's marker (its request id under the tenant's tag) says it was applied.
-- KEYS: one marker per row. ARGV: marker ttl s, then per row: number of scopes n, day, month, picodollars, and
-- the n scopes' key bases. Answers how many rows were applied now. A row's marker is set after its money (Redis
-- keeps a script's writes made before an error: a marker set first left a row whose apply failed marked as applied,
-- its money never counted; a retry may count what applied twice instead: an early refusal, never overspend).
local ttl, i, applied = tonumber(ARGV[1]), 2, 0
for k = 1, #KEYS do
  local n, day, month, money = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  if redis.call('EXISTS', KEYS[k]) == 0 then
    for j = 1, n do
      add_money(ARGV[i + 3 + j] .. ':day:' .. day, money, DAY_TTL)
      add_money(ARGV[i + 3 + j] .. ':month:' .. month, money, MONTH_TTL)
    end
    redis.call('SET', KEYS[k], 1, 'EX', ttl)
    applied = applied + 1
  end
  i = i + 4 + n
end
return applied
