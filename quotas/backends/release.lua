-- Free a request's concurrency slot in each of its scopes (see quotas/backends/redis.py `release`): one a settle
-- kept (settle.lua's keep flag: its answer was written down and billed, not yet handed over to its client), or one
-- whose request ended before its settle ran. Only the slot: the reservation's record, money and tokens are the
-- settle's. A slot already free (released, reaped, cancelled, taken over by a follow-on, its lease run out) is left
-- as it is, so a repeat changes nothing.
-- KEYS: each scope's inflight (zset). ARGV: request id. Answers how many slots it freed.
local freed = 0
for i = 1, #KEYS do freed = freed + redis.call('ZREM', KEYS[i], ARGV[1]) end
return freed
