-- What scopes have spent today and this month, by Redis' clock (see quotas/backends/redis.py; clock.lua is
-- prepended). ARGV: key bases. Answers day, month, then 2 per base: spent today, spent this month.
local c = clock()
local out = {c.day, c.month}
for i = 1, #ARGV do
  table.insert(out, counter(ARGV[i] .. ':day:' .. c.day))
  table.insert(out, counter(ARGV[i] .. ':month:' .. c.month))
end
return out
