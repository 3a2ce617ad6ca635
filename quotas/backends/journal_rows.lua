-- Add the money of ledger rows settled on a replica's fallback during an outage to the shared counters, each row
-- once, whichever replica sends it and however often (see quotas/backends/failover.py; shared.lua is prepended).
-- A row's marker (its request id under the tenant's tag) says it was applied.
-- KEYS: one marker per row. ARGV: marker ttl s, then per row: number of scopes n, day, month, picodollars, and
-- the n scopes' key bases. Answers how many rows were applied now.
local ttl, i, applied = tonumber(ARGV[1]), 2, 0
for k = 1, #KEYS do
  local n, day, month, money = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  if redis.call('SET', KEYS[k], 1, 'NX', 'EX', ttl) then
    for j = 1, n do
      add_money(ARGV[i + 3 + j] .. ':day:' .. day, money, DAY_TTL)
      add_money(ARGV[i + 3 + j] .. ':month:' .. month, money, MONTH_TTL)
    end
    applied = applied + 1
  end
  i = i + 4 + n
end
return applied
