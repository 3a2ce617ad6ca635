"""The idempotency store on Redis (`RedisIdempotency`, for replicas): each record claimed and finished by a Lua
script, so a replica that did not serve the first request replays it too, with the per-tenant bounds of
quotas/idempotency.py's `Limits` kept by the same scripts.

Redis failing (a timeout, a dropped connection, a restart), each script is idempotent for its request, so a call
whose reply was lost is simply made again:
- a claim (`begin`) is tried twice; a claim already held by the same request is that request's claim, so a reply
  lost after the script ran does not make it wait on itself. If Redis still fails, `begin` raises
  `IdempotencyUnavailable` (a retryable 503 at the gateway, gateway/pipeline/idempotency.py) before anything is
  counted, charged or run, and the claim the lost reply may have made is given up in the background;
- an answer (`finish`) comes after the request was answered, written to the ledger and settled: failing it would
  lose the answer and, if its claim were given up, let the SDK's retry run and be billed a second time. So it is
  tried three times at once, and if Redis still fails, `finish` returns anyway (the answer is delivered) and the
  answer is owed: kept in memory and written by one background task, retried every few seconds (at most
  `MAX_RETRY_DELAY_S`, under the gateway's 10 s wait for a running key) for `keep_trying_s` (15 minutes). Its claim
  is not given up: until the write lands, a retry on this replica replays the owed answer from memory, and one on
  another replica finds the key `running` (it waits, then gets the usual 409 with Retry-After) or Redis down (503),
  never a fresh claim. The `running` record itself protects the key for the claim's lease (10 minutes by
  default); the owed write, when it lands, stores the answer even if that lease has ended meanwhile, and a retry
  that finds it ended is told the request was billed (its row is in the ledger: see below), so only an outage longer
  than the lease during which a retry on a gateway without the ledger reached Redis first can run a key twice, and
  that is logged (the owed write then finds another request's claim), as is an owed write given up after
  `keep_trying_s`;
- a claim given up (`abandon`: the request failed) is tried twice, then owed in the background the same way (until
  then a retry gets 409, then runs);
- an answer whose ledger row is still pending after the gateway's wait for it (gateway/pipeline/idempotency.py's
  `keep_when_written`: a slow disk, a database that cannot commit now) is held here until the row's fate is final
  (`finish_when_written`), however late: stored once the row commits, as the SQL stores keep it (there it commits
  with the row), its claim given up if the row is refused for good. Before, the gateway stopped following a row after
  120 s: a row committed later billed the tenant with no answer kept, and a retry after the claim's lease ran and was
  billed again. Nothing lives longer for it: the `running` record keeps the lease its claim set, renewed only while
  its request runs (`renew`), never for this, so a claim whose owner died frees its key when its lease ends, as
  before (but see below: a billed one is not run again); what is held is this process's memory, bounded with the
  owed work's bounds (`MAX_OWED` answers, `MAX_OWED_BYTES`; beyond them logged and dropped, the claim left to its
  lease), released when the row's future settles (the ledger settles every one: it commits, is refused, or fails as
  the ledger closes) and lost, logged, at `close`. A row committed after the lease still stores its answer (over
  its lapsed claim, as SQLite's `done` update lands on an expired record not yet pruned), unless another request
  claimed the key meanwhile (logged: it ran again), as in the SQL stores.
A claim's lease is a field of its record (`lease`, Redis's clock), not the record's expiry: the record is kept
`CLAIM_KEPT_S` (24 h) past it. The answer is stored only after its row is durable, so a gateway killed in between, or
while the answer was owed in its memory, left a claim that lapsed with its lease, and the client's retry took the key
over, ran and was billed again. Now a retry that finds a claim's lease over looks for its owner's row in the gateway's
ledger (`rows`, set once the ledger is open): a row of an answer (status ok) and the retry is told its request ran and
was billed, its answer lost (`lost()`: the 409 of an answer not kept), and never runs; no row, or the row of a request
that failed or whose client left (whose claim it would have given up), and the key is taken over, as before, by a
script that takes it only from that owner. That ledger must be the one the dead owner wrote: each claim records the
id of its owner's ledger (quotas/ledger_identity.py: the workers of one data directory share one SQLite file, and so
one id; the replicas of a fleet database would share theirs, but there the records are in PostgreSQL, committed with
the row: gateway/stores.py). Replicas that share Redis but write a SQLite file each (hosts of their own) have ids of
their own: a lapsed claim of another ledger's owner (or of a replica of the release before ids, whose row is not
here) may have a row where this gateway cannot read, and the retry looked only here, found nothing, ran and was
billed again. Now it is told that (`unknown()`: a 409 saying whether it ran is not known here; a new key runs it),
never run again under the key, billed or not. The ledger failing to say is `IdempotencyUnavailable` (a 503, nothing
claimed); a store without `rows` takes a lapsed claim over (tools, tests).
Owed work is bounded (`MAX_OWED` entries, `MAX_OWED_BYTES` of answers); beyond that it is dropped: the claim then
stays `running` until its lease ends. Work still owed when the store closes is logged and lost.
An outage is logged as one, with a count of the writes it lost (quotas/idempotency_outage.py), not a line a write.
The SQL stores need none of this: their answer commits with the ledger row (one transaction, or neither), and a
database that cannot be reached for a claim is a 503 (PostgreSQL: `LedgerUnavailable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from quotas.idempotency import (
    DEFAULT_LIMITS,
    Begun,
    Claim,
    Full,
    GiveUp,
    IdempotencyStore,
    Limits,
    Mismatch,
    Replay,
    Running,
    _decoded,
    _encoded,
    _follow,
    _kept,
    lost,
    unknown,
)
from quotas.idempotency_outage import OutageLog
from quotas.ledger import LedgerUnavailable
from quotas.ledger_identity import ledger_id

log = logging.getLogger("tiergate.idempotency")

BEGIN_TRIES = 2  # a claim's tries before the request is refused (503, retryable)
FINISH_TRIES = 3  # an answer's tries at once, before it is owed to the background
ABANDON_TRIES = 2
RETRY_DELAYS_S = (0.05, 0.2)  # between tries at once
KEEP_TRYING_S = 900.0  # how long owed work is retried: longer than the gateway's lease (600 s)
MAX_RETRY_DELAY_S = 5.0  # between background rounds, at most: under the gateway's wait for a running key (10 s)
# a claim's record is kept this long past its lease (the answers' TTL by default), so that a retry after its owner died
# is told whether that request was billed (its ledger row committed: its answer was lost) instead of running again
CLAIM_KEPT_S = 24 * 3600.0
MAX_OWED = 10_000  # owed writes kept at most
MAX_OWED_BYTES = 64 * 1024 * 1024  # owed answers kept at most


class IdempotencyUnavailable(LedgerUnavailable):
    """Redis could not be reached to claim or read a key: nothing was claimed, the request may be retried. (A
    `LedgerUnavailable`, so a caller that does not know it still answers 503, not 500.)"""


# Redis: per tenant, KEYS[2] a sorted set of its live keys (scored by when each expires, Redis's clock, in ms) and
# KEYS[3] a hash of their stored sizes, with their sum under '' (a key has 1 character at least); a claim drops the
# expired ones first, so only live ones count. Both live as long as their longest record.
_HELD = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function hold(ttl)
  for _, k in ipairs({KEYS[2], KEYS[3]}) do
    if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
  end
end
local function resize(member, size)
  local old = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  if size > 0 then redis.call('HSET', KEYS[3], member, size) else redis.call('HDEL', KEYS[3], member) end
  if size ~= old then redis.call('HINCRBY', KEYS[3], '', size - old) end
end
"""
# a running record of the same owner is its claim (a claim whose reply was lost, tried again); one whose lease (its
# `lease`, Redis's clock in ms; a record written before it had its key's expiry for a lease) has ended is 'lapsed',
# with its owner, body and the id of the ledger its owner writes ('' for a record written before it), unless ARGV[7]
# names that owner (its row looked for and not found): then taken over. A claim records ARGV[9], its own ledger's id.
_BEGIN = _HELD + """
local now = now_ms()
local found = redis.call('GET', KEYS[1])
if found then
  local rec = cjson.decode(found)
  if rec.state == 'running' and rec.owner ~= ARGV[2] and rec.lease ~= nil and rec.lease <= now then
    if rec.owner ~= ARGV[7] then return {'lapsed', rec.owner, rec.fp, rec.ledger or ''} end
  else
    if rec.fp ~= ARGV[1] then return {'mismatch'} end
    if rec.state == 'done' then return {'replay', rec.answer} end
    if rec.owner == ARGV[2] then return {'claim'} end
    return {'running'}
  end
end
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do resize(gone, 0) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5])
    or tonumber(redis.call('HGET', KEYS[3], '') or '0') >= tonumber(ARGV[6]) then
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  return {'full', tostring(first[2] and (tonumber(first[2]) - now) or 1000)}
end
redis.call('SET', KEYS[1], cjson.encode({state = 'running', fp = ARGV[1], owner = ARGV[2], ledger = ARGV[9],
                                         lease = now + tonumber(ARGV[3])}), 'PX', tonumber(ARGV[3]) + tonumber(ARGV[8]))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
hold(tonumber(ARGV[3]))
return {'claim'}
"""
# stored over the owner's claim, or over nothing (its lease ended while the write was owed: the request did run);
# 0 when another request holds the key (it ran again)
_FINISH = _HELD + """
local found = redis.call('GET', KEYS[1])
if found and cjson.decode(found).owner ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], cjson.encode({state = 'done', fp = ARGV[1], owner = ARGV[2], answer = ARGV[3]}),
           'PX', ARGV[4])
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[4]), ARGV[5])
resize(ARGV[5], tonumber(ARGV[6]))
hold(tonumber(ARGV[4]))
return 1
"""
# a running claim's lease extended by its owner (1), or 0: answered, given up, its lease ended (lost, as it was when
# the record went with it), or another request's since
_RENEW = _HELD + """
local found = redis.call('GET', KEYS[1])
if not found then return 0 end
local rec = cjson.decode(found)
local now = now_ms()
if rec.owner ~= ARGV[1] or rec.state ~= 'running' or (rec.lease ~= nil and rec.lease <= now) then return 0 end
rec.lease = now + tonumber(ARGV[2])
redis.call('SET', KEYS[1], cjson.encode(rec), 'PX', tonumber(ARGV[2]) + tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
hold(tonumber(ARGV[2]))
return 1
"""
_ABANDON = _HELD + """
local found = redis.call('GET', KEYS[1])
if found then
  local rec = cjson.decode(found)
  if rec.owner == ARGV[1] and rec.state == 'running' then
    redis.call('DEL', KEYS[1])
    redis.call('ZREM', KEYS[2], ARGV[2])
    resize(ARGV[2], 0)
  end
end
return 1
"""


@dataclass
class _Owed:
    """A write Redis refused, retried in the background until `until` (time.monotonic())."""

    what: str  # 'finish' or 'abandon' (its script)
    keys: list[str]
    args: list[Any]
    until: float
    fingerprint: str = ""
    answer: str | None = None  # a finish's answer, replayed from here meanwhile
    size: int = 0  # its bytes

    @property
    def owner(self) -> str:
        """The request whose claim it is: the scripts' arguments, `finish`'s [fingerprint, owner, ...] and
        `abandon`'s [owner, key]."""
        return str(self.args[1] if self.what == "finish" else self.args[0])


class RedisIdempotency(IdempotencyStore):
    def __init__(self, url: str, *, timeout_s: float = 1.0, limits: Limits = DEFAULT_LIMITS,
                 keep_trying_s: float = KEEP_TRYING_S) -> None:
        import redis.asyncio as aioredis

        self.limits = limits
        self.keep_trying_s = keep_trying_s
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._begin = self._redis.register_script(_BEGIN)
        self._finish = self._redis.register_script(_FINISH)
        self._abandon = self._redis.register_script(_ABANDON)
        self._renew = self._redis.register_script(_RENEW)
        # an answer by (tenant, key), so that a retry here replays it; a give-up by (tenant, key, owner): each request's
        # claim its own, so a retry's give-up (which may delete nothing) never replaces an earlier request's
        self._owed: dict[tuple[str, ...], _Owed] = {}
        self._owed_bytes = 0
        self._worker: asyncio.Task[None] | None = None
        self._following: dict[Claim, int] = {}  # answers whose ledger row is pending, and their bytes
        self._following_bytes = 0
        self._closed = False
        self._outage = OutageLog(log, keep_trying_s)  # an outage in the log as one, and the writes it lost
        self._ledger_of: object = None  # the `rows` whose id `_ledger` is
        self._ledger = ""

    @staticmethod
    def _keys(tenant: str, key: str) -> list[str]:
        """The record, the tenant's live keys and their sizes."""
        return [f"tg:idem:{tenant}:{key}", f"tg:idem-live:{tenant}", f"tg:idem-size:{tenant}"]

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        owed = self._owed.get((tenant, key))
        if owed is not None and owed.answer is not None:  # answered here, not yet in Redis
            return _decoded(owed.answer) if owed.fingerprint == fingerprint else Mismatch()
        args = [fingerprint, owner, int(lease_s * 1000), key, self.limits.records, self.limits.bytes, "",
                int(CLAIM_KEPT_S * 1000), await self._ledger_id()]
        got = await self._claim(tenant, key, args, lease_s)
        kind = _text(got[0])
        if kind == "lapsed":  # its owner's lease ended, its answer not stored: did its row commit (it was billed)?
            lapsed, fp, its_ledger = _text(got[1]), _text(got[2]), _text(got[3]) if len(got) > 3 else ""
            if await self._ran(lapsed):
                log.warning("Idempotency-Key %r (tenant %s): the request that claimed it (%s) was billed, but its "
                            "answer was never stored (its gateway died); a retry is told so, never run again", key,
                            tenant, lapsed)
                return lost() if fp == fingerprint else Mismatch()
            if self.rows is not None and its_ledger != args[8]:  # its row, if any, is where this gateway cannot read
                log.warning("Idempotency-Key %r (tenant %s): the request that claimed it (%s) ran on a gateway that "
                            "died and writes another ledger (%s) than this one (%s): whether it was billed is not "
                            "known here, so a retry is told so, never run again under the key", key, tenant, lapsed,
                            its_ledger or "not recorded", args[8])
                return unknown() if fp == fingerprint else Mismatch()
            args[6] = lapsed  # no row in the ledger it wrote: taken over, unless its record changed meanwhile
            got = await self._claim(tenant, key, args, lease_s)
            kind = _text(got[0])
        if kind == "claim":
            return Claim(tenant, key, fingerprint, owner)
        if kind == "replay":
            return _decoded(got[1])
        if kind == "full":
            return Full(max(1.0, float(got[1]) / 1000))
        return Mismatch() if kind == "mismatch" else Running()

    async def _claim(self, tenant: str, key: str, args: list[Any], lease_s: float) -> Any:
        """The claim script's answer, tried `BEGIN_TRIES` times; Redis failing, `IdempotencyUnavailable`."""
        keys = self._keys(tenant, key)
        try:
            got = await self._tries(self._begin, keys, args, BEGIN_TRIES)
        except RedisError as exc:  # a try may have claimed it before its reply was lost: given up when Redis answers
            self._outage.failed(exc)
            self._owe(tenant, key, _Owed("abandon", keys, [args[1], key],
                                         time.monotonic() + min(lease_s, self.keep_trying_s)))
            raise IdempotencyUnavailable(f"the idempotency records (Redis) cannot be reached: {exc}") from exc
        self._outage.answered()
        return got

    async def _ledger_id(self) -> str:
        """The id of the ledger this gateway writes (`rows`: quotas/ledger_identity.py), read once; '' without one.
        The ledger failing to say, `IdempotencyUnavailable`: nothing is claimed or run."""
        rows = self.rows
        if rows is None:
            return ""
        if self._ledger_of is not rows:
            try:
                self._ledger = await asyncio.to_thread(ledger_id, rows.read_source())
            except Exception as exc:
                raise IdempotencyUnavailable(f"the ledger cannot be read for its id: {exc}") from exc
            self._ledger_of = rows
        return self._ledger

    async def _ran(self, owner: str) -> bool:
        """Whether request `owner`'s ledger row committed as an answer (status ok: a request that failed or whose
        client left wrote its row and gave its claim up, so a retry runs); False without the gateway's ledger (`rows`).
        The ledger failing to say, `IdempotencyUnavailable`: nothing is claimed or run."""
        if self.rows is None:
            return False
        try:
            row = await asyncio.to_thread(self.rows.get, owner)
        except Exception as exc:
            raise IdempotencyUnavailable(f"the ledger cannot be read for the row of request {owner}: {exc}") from exc
        return row is not None and row.status == "ok"

    async def finish(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        """Store the answer; never raises for Redis: what cannot be written now is owed (see the module's doc)."""
        text, size = _kept(answer, self.limits)  # over the bound, what stands in for it: a retry is told, not run
        keys = self._keys(claim.tenant, claim.key)
        args = [claim.fingerprint, claim.owner, text, int(ttl_s * 1000), claim.key, size]
        try:
            stored = await self._tries(self._finish, keys, args, FINISH_TRIES)
        except RedisError as exc:
            self._outage.failed(exc)
            log.debug("the answer to %s (tenant %s) could not be stored in Redis, retrying in the background: %s",
                      claim.owner, claim.tenant, exc)
            self._owe(claim.tenant, claim.key, _Owed("finish", keys, args,
                                                     time.monotonic() + min(ttl_s, self.keep_trying_s),
                                                     claim.fingerprint, text, size))
            return
        self._outage.answered()
        if not stored:
            _ran_again(claim.owner, claim.tenant)

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Its lease extended, tried once (one that raised is tried again a thirtieth of the lease later, by
        gateway/pipeline/idempotency.py); Redis failing raises."""
        keys = self._keys(claim.tenant, claim.key)
        return bool(await self._renew(keys=keys, args=[claim.owner, int(lease_s * 1000), claim.key,
                                                       int(CLAIM_KEPT_S * 1000)]))

    async def stored(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        owed = self._owed.get((tenant, key))
        if owed is not None and owed.answer is not None:  # answered here, not yet in Redis
            return _decoded(owed.answer) if owed.fingerprint == fingerprint else Mismatch()
        found = await self._redis.get(self._keys(tenant, key)[0])
        if found is None or (rec := json.loads(found)).get("state") != "done":
            return None
        return _decoded(rec["answer"]) if rec["fp"] == fingerprint else Mismatch()

    async def abandon(self, claim: Claim) -> None:
        keys, args = self._keys(claim.tenant, claim.key), [claim.owner, claim.key]
        try:
            await self._tries(self._abandon, keys, args, ABANDON_TRIES)
        except RedisError as exc:
            self._outage.failed(exc)
            self._owe(claim.tenant, claim.key, _Owed("abandon", keys, args,
                                                     time.monotonic() + self.keep_trying_s))
        else:
            self._outage.answered()

    def finish_when_written(self, written: asyncio.Future[None], claim: Claim, answer: dict[str, Any],
                            ttl_s: float, *, give_up: GiveUp = None) -> None:
        """Hold the answer until its row's fate is final, then store it or give the claim up (see the module's doc:
        bounded as owed work is; the claim's TTL is not extended)."""
        size = _encoded(answer)[1]
        if len(self._following) >= MAX_OWED or self._following_bytes + size > MAX_OWED_BYTES:
            log.error("too many answers waiting for their ledger rows: the answer to %s (tenant %s) is dropped; its "
                      "claim stays running until its lease ends", claim.owner, claim.tenant)
            return
        self._following[claim] = size
        self._following_bytes += size

        def final(row: asyncio.Future[None]) -> None:
            self._following_bytes -= self._following.pop(claim, 0)
            if not self._closed:
                _follow(self, row, claim, answer, ttl_s, give_up)

        written.add_done_callback(final)

    async def close(self) -> None:
        self._closed = True
        if self._following:
            log.error("closing with %d answers whose ledger rows are still pending: not stored (their claims stay "
                      "running until their leases end)", len(self._following))
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._owed:
            log.error("closing with %d idempotency writes Redis refused: lost (their keys may run again)",
                      len(self._owed))
        if lost := self._outage.lost_words():
            log.error("closing while Redis refuses idempotency writes: %s", lost)
        await self._redis.aclose()

    @staticmethod
    async def _tries(script: Any, keys: list[str], args: list[Any], tries: int) -> Any:
        """`script` run until it answers, `tries` times at most; the last RedisError raised."""
        for i in range(tries):
            try:
                return await script(keys=keys, args=args)
            except RedisError:
                if i == tries - 1:
                    raise
                await asyncio.sleep(RETRY_DELAYS_S[min(i, len(RETRY_DELAYS_S) - 1)])
        raise AssertionError("unreachable")

    def _owe(self, tenant: str, key: str, owed: _Owed) -> None:
        """Keep `owed` for the background worker (an owed answer is never replaced by its own claim's give-up)."""
        owner = owed.owner
        if owed.what != "finish":
            answer = self._owed.get((tenant, key))
            if answer is not None and answer.owner == owner:
                return
        elif (given_up := self._owed.get((tenant, key, owner))) is not None:  # the answer supersedes it
            self._forget((tenant, key, owner), given_up)
        at = (tenant, key) if owed.what == "finish" else (tenant, key, owner)
        held = self._owed.get(at)
        grown = owed.size - (held.size if held is not None else 0)
        if (held is None and len(self._owed) >= MAX_OWED) or self._owed_bytes + grown > MAX_OWED_BYTES:
            self._outage.lost("dropped", f"too many idempotency writes owed to Redis: the {owed.what} of key {key!r} "
                                         f"(tenant {tenant}) is dropped; its claim stays running until its lease ends")
            return
        self._owed[at] = owed
        self._owed_bytes += grown
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._repay())

    def _forget(self, at: tuple[str, ...], owed: _Owed) -> None:
        if self._owed.get(at) is owed:
            del self._owed[at]
            self._owed_bytes -= owed.size

    async def _repay(self) -> None:
        """Write what is owed, oldest first; a round stops at the first Redis error and the next waits longer."""
        delay = RETRY_DELAYS_S[0]
        while self._owed:
            failed = False
            for at, owed in list(self._owed.items()):
                if owed.until <= time.monotonic():
                    self._forget(at, owed)
                    self._outage.lost(owed.what, f"gave up the {owed.what} of idempotency key {at[1]!r} (tenant "
                                                 f"{at[0]}): Redis refused it for too long"
                                                 f"{'; a retry may run again' if owed.what == 'finish' else ''}")
                    continue
                try:
                    script = self._finish if owed.what == "finish" else self._abandon
                    done = await script(keys=owed.keys, args=owed.args)
                except RedisError as exc:
                    self._outage.failed(exc)
                    failed = True
                    break
                except Exception:  # not Redis refusing: trying again will not help
                    log.exception("the %s of idempotency key %r (tenant %s) failed", owed.what, at[1], at[0])
                    done = True
                else:
                    self._outage.answered()
                self._forget(at, owed)
                if owed.what == "finish" and not done:
                    _ran_again(owed.args[1], at[0])
            if failed:
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY_S)
            else:
                delay = RETRY_DELAYS_S[0]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ran_again(owner: str, tenant: str) -> None:
    log.error("the answer to %s (tenant %s) was not stored: its claim had expired and another request with its "
              "Idempotency-Key claimed it (it ran, and was charged, again)", owner, tenant)
