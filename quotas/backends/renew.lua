-- Push a reservation's lease ahead while its request still runs on a live replica (see quotas/backends/redis.py
-- `renew`): its entry in the tenant's leases (what the reapers claim from) and its slot in each scope's inflight
-- set go to TIME + lease, and each inflight set lives as long. Only a reservation still held ('r'), and only entries
-- still there: one settled, reaped or cancelled, or a slot a follow-on took over, is left as it is.
-- KEYS: the reservation's record, the tenant's leases, then each scope's inflight (zset).
-- ARGV: request id, lease ms, window ms. Answers 1 if renewed, 0 if not held.
if redis.call('HGET', KEYS[1], 'st') ~= 'r' then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, lease, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local deadline = now + lease
local function push(key)
  local at = redis.call('ZSCORE', key, rid)
  if at and tonumber(at) < deadline then redis.call('ZADD', key, deadline, rid) end
  return at
end
push(KEYS[2])
for i = 3, #KEYS do
  if push(KEYS[i]) then redis.call('PEXPIRE', KEYS[i], window + lease + 1000) end
end
return 1
