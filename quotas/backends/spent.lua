-- What scopes have spent today and this month, by Redis' clock (see quotas/backends/redis.py; clock.lua is
-- prepended). ARGV: key bases. Answers day, month, then 2 per base: spent today, spent this month.
local c = clock()
local out = {c.day, c.month}
for i = 1, #ARGV do
  table.insert(out, tonumber(redis.call('GET', ARGV[i] .. ':day:' .. c.day) or '0'))
  table.insert(out, tonumber(redis.call('GET', ARGV[i] .. ':month:' .. c.month) or '0'))
end
return out
