-- Push a reservation's lease ahead while its request still runs on a live replica (see quotas/backends/redis.py
-- `renew`): its entry in the tenant's leases (what the reapers claim from) and its slot in each scope's inflight
-- set go to TIME + lease, and each inflight set lives as long. Only entries still there: a reservation settled,
-- reaped or cancelled is no longer in the leases, and a slot freed (or taken over by a follow-on) no longer in an
-- inflight set, and neither comes back. A slot a settle kept (settle.lua's keep flag: its answer is still being
-- handed over) is still there, its record settled, and is pushed as a held reservation's.
-- KEYS: the reservation's record, the tenant's leases, then each scope's inflight (zset).
-- ARGV: request id, lease ms, window ms. Answers 1 if its reservation is held, 0 if not (a kept slot's too).
local held = redis.call('HGET', KEYS[1], 'st') == 'r'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, lease, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local deadline = now + lease
local function push(key)
  local at = redis.call('ZSCORE', key, rid)
  if at and tonumber(at) < deadline then redis.call('ZADD', key, deadline, rid) end
  return at
end
if held then push(KEYS[2]) end
for i = 3, #KEYS do
  if push(KEYS[i]) then redis.call('PEXPIRE', KEYS[i], window + lease + 1000) end
end
if held then return 1 end
return 0
