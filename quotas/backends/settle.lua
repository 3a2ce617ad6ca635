-- Finish one reservation, exactly once (see quotas/backends/redis.py; shared.lua is prepended).
-- kind 'settle': replace the reservation by the real use; 'reap': its lease ran out and no row billed it, so
-- return all of it (money, tokens, slot) and keep its record a while, marked reaped, so that a late settle
-- bills the real use; 'cancel': undo it as if it had never been admitted (its reserve's answer was lost), a
-- follow-on's slot taken over given back to the attempt it follows, unless that attempt is done with its slot: its
-- trace (`released:<id>`, written by release.lua, or here by its settle, reap or cancel, where its slot was no longer
-- there to free: taken over) says a slot given back to it would be nobody's, counted until its lease ran out.
-- A settled record stays as a tombstone for `done ttl`, so the same settle sent again (its answer was lost)
-- changes nothing. A settle that finds no reservation held (none was made, or it was cancelled: the request
-- ran on a replica's fallback during an outage) adds the real use to the scopes in ARGV, on the day and month
-- given, else on those of the request's arrival as reserve.lua dates it now (moved into [TIME - lag, TIME]).
-- A fallback's ledger row applied by its id names its marker (journal_rows.lua's, `jrow:<id>`, kept as long): a
-- repeat after the tombstone is gone (the note "applied" lost, a restart 15 minutes later) finds it and changes
-- nothing. The marker is the script's last write: Redis keeps a script's writes made before an error, and a marker
-- set before the row applied would make every retry of a row that failed on the way a no-op.
-- KEYS: the reservation's record, the tenant's leases, its slot's trace (written where a finish that frees the slot
--       finds it gone, kept ARGV's last seconds), then optionally: the row's marker (kind 'settle'), or the trace of
--       the attempt a follow-on follows (kind 'cancel')
-- ARGV: request id, real tokens, real picodollars, kind, done ttl s, reaped ttl s, day, month ('': dated by the
--       arrival and Redis' clock), arrival (epoch ms by the gateway's clock; -1: none), lag ms, number of scopes,
--       their key bases, then '1' where a settle keeps the concurrency slot (its answer not yet handed over to its
--       client: release.lua frees it then, or its lease's end) ('' or absent: the settle frees it), then the
--       marker's ttl s (with the marker), then (kind 'reap') the reaper's claim's deadline (ms; reap.lua), then the
--       trace's ttl s (at least as long as a cancel of a follow-on is retried: see redis.py `released_ttl_s`)
-- Answers 0: nothing to do (already finished, the marker's row applied before, or a reap of a lease renewed since
--         its claim); 1: a held reservation
--         finished; 2: a reaped one billed; 3: one not held billed
local rid, tokens, money, kind = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local done_ttl, reaped_ttl, day, month = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8]
local at, lag, n = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local keep_slot = kind == 'settle' and ARGV[12 + n] == '1'
local marker = kind == 'settle' and KEYS[4]
if marker and redis.call('EXISTS', marker) == 1 then return 0 end

-- the answer of a settle done (or found done before: a tombstone), its row's marker set last
local function done(code)
  if marker then redis.call('SET', marker, 1, 'EX', tonumber(ARGV[13 + n])) end
  return code
end

if kind == 'reap' then
  -- its owner renewed it after the reaper's claim (renew.lua pushes the lease past the claim's deadline): alive, its
  -- owner settles it; another reaper's later claim (the first one's ran out) is that reaper's
  local lease_at, claimed = redis.call('ZSCORE', KEYS[2], rid), tonumber(ARGV[14 + n] or '-1')
  if lease_at and claimed >= 0 and tonumber(lease_at) > claimed then return 0 end
end
local flat = redis.call('HGETALL', KEYS[1])
local rec = {}
for j = 1, #flat, 2 do rec[flat[j]] = flat[j + 1] end
redis.call('ZREM', KEYS[2], rid)

local function bases_of_record()
  local out = {}
  for j = 1, tonumber(rec.n) do out[j] = rec['b' .. j] end
  return out
end

local function bill(bases, day, month, delta)
  for _, b in ipairs(bases) do
    add_money(b .. ':day:' .. day, delta, DAY_TTL)
    add_money(b .. ':month:' .. month, delta, MONTH_TTL)
  end
end

local function tombstone(state)
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'st', state)
  redis.call('EXPIRE', KEYS[1], done_ttl)
end

if rec.st == 's' then return done(0) end
if rec.st == 'x' then
  if kind ~= 'settle' then return 0 end
  bill(bases_of_record(), rec.day, rec.month, money)
  tombstone('s')
  return done(2)
end
if rec.st == nil or rec.st == 'c' then
  if kind == 'settle' then
    if day == '' then
      local c = clock(at, lag)
      day, month = c.day, c.month
    end
    local bases = {}
    for j = 1, n do bases[j] = ARGV[11 + j] end
    bill(bases, day, month, money)
    tombstone('s')
    return done(3)
  end
  if kind == 'cancel' then tombstone('c') end  -- a reserve that arrives after its cancel charges nothing
  return 0
end

-- a follow-on's cancel: the slot it took over from the attempt it follows (reserve.lua `fs<scope>`), back to that
-- attempt as it was (its lease then; its own release or lease frees it), where the follow-on still held it and that
-- attempt has not freed its slot since (its trace, KEYS[4]: its release, settle, reap or cancel found it taken over,
-- and will not come again to free what is given back)
local function give_back_slot(key, j)
  local at = rec['fs' .. j]
  if not at or (KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1) then return end
  redis.call('ZADD', key, 'NX', at, rec.f)
  if redis.call('PTTL', key) < 0 then redis.call('PEXPIREAT', key, math.floor(tonumber(at)) + 1000) end
end

-- a held reservation: its own record says what it charged, where, on which day and month
local gone = false  -- a slot of its own no longer there to free (taken over by a follow-on, released, lease ended)
for j, b in ipairs(bases_of_record()) do
  local old = redis.call('HGET', b .. ':tpmv', rid)
  if old then
    if kind == 'settle' then
      redis.call('HSET', b .. ':tpmv', rid, tokens)
      add_capped(b .. ':tpmsum', tokens - tonumber(old))
    else
      redis.call('HDEL', b .. ':tpmv', rid)
      redis.call('DECRBY', b .. ':tpmsum', tonumber(old))
      redis.call('ZREM', b .. ':tpm', rid)
    end
  end
  if kind == 'cancel' then redis.call('ZREM', b .. ':rpm', rid) end
  if not keep_slot then
    local freed = redis.call('ZREM', b .. ':inflight', rid)
    if freed == 0 then
      gone = true
    elseif kind == 'cancel' then
      give_back_slot(b .. ':inflight', j)
    end
  end
end
if gone then redis.call('SET', KEYS[3], 1, 'EX', tonumber(ARGV[15 + n])) end
local delta = -tonumber(rec.pico)
if kind == 'settle' then delta = money + delta end
bill(bases_of_record(), rec.day, rec.month, delta)
if kind == 'reap' then
  redis.call('HSET', KEYS[1], 'st', 'x')
  redis.call('EXPIRE', KEYS[1], reaped_ttl)
elseif kind == 'settle' then
  tombstone('s')
else
  tombstone('c')
end
return done(1)
