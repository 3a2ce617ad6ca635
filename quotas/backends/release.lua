-- Free a request's concurrency slot in each of its scopes (see quotas/backends/redis.py `release`): one a settle
-- kept (settle.lua's keep flag: its answer was written down and billed, not yet handed over to its client), or one
-- whose request ended before its settle ran. Only the slot: the reservation's record, money and tokens are the
-- settle's. A slot already free (released, reaped, cancelled, taken over by a follow-on, its lease run out) is left
-- as it is, so a repeat changes nothing; its trace is written then, for a while: a follow-on that took it over and
-- is cancelled later (its reserve's answer lost, the cancel retried) must not give the slot back to this request,
-- which will not free it again (settle.lua `give_back_slot`: it would be counted until its lease ran out).
-- KEYS: the slot's trace, then each scope's inflight (zset). ARGV: request id, the trace's ttl s. Answers how many
-- slots it freed.
local freed = 0
for i = 2, #KEYS do freed = freed + redis.call('ZREM', KEYS[i], ARGV[1]) end
if freed < #KEYS - 1 then redis.call('SET', KEYS[1], 1, 'EX', tonumber(ARGV[2])) end
return freed
