"""Cache entries in Redis, shared by every gateway replica (selected by `TIERGATE_REDIS_URL`).

Keys, under `prefix` (default `tg:cache`):
- `e:<id>`            hash: the entry's fields, its vector as float32 bytes
- `x:<scope>:<exact>` the id of the entry with that scope and exact key
- `lru`, `exp`        sorted sets: id by last use (eviction order), id by expiry time
- `t:<tenant>`        set: the tenant's entry ids (purge, version reclaim)
- `l:<tenant>`        sorted set: the tenant's ids by last use (its own bound, and eviction from the largest)
- `sizes`             sorted set: tenant by number of entries
- `bytes`             hash: tenant -> what its entries hold (`stored_bytes`, the entry's `size` field; an entry
                      written before the byte budget has none and counts nothing)
- `bumpv`, `bumpt`    hashes: tenant -> its data version at its last bump, and when (`put` refuses older answers)
- `log`               stream of `put` / `del` events: how every replica's faiss index follows the others

Writes and deletes are Lua scripts, so the keys of one entry never disagree and the size bounds (per tenant, in
entries and in bytes, and overall, evicting from the largest tenant; see `cache.store`) hold under any number of
replicas. The scripts build keys from their arguments, which a single Redis (or a replicated primary) allows;
Redis Cluster would need all keys under one hash tag. Redis errors surface as `CacheStoreError`; the caller treats
them as a miss.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import redis
from redis.exceptions import RedisError

from cache.store import MAX_BYTES_PER_TENANT, CacheStore, CacheStoreError, Entry, check_bounds, stored_bytes

_DEL = """
local function del(prefix, eid)
  local f = redis.call('HMGET', prefix .. 'e:' .. eid, 'scope_id', 'exact_key', 'tenant', 'partition', 'size')
  if not f[1] then return 0 end
  if f[5] then redis.call('HINCRBY', prefix .. 'bytes', f[3], -tonumber(f[5])) end
  redis.call('DEL', prefix .. 'e:' .. eid)
  local xk = prefix .. 'x:' .. f[1] .. ':' .. f[2]
  if redis.call('GET', xk) == eid then redis.call('DEL', xk) end
  redis.call('ZREM', prefix .. 'lru', eid)
  redis.call('ZREM', prefix .. 'exp', eid)
  redis.call('SREM', prefix .. 't:' .. f[3], eid)
  if redis.call('ZREM', prefix .. 'l:' .. f[3], eid) == 1 then redis.call('ZINCRBY', prefix .. 'sizes', -1, f[3]) end
  redis.call('XADD', prefix .. 'log', 'MAXLEN', '~', '100000', '*', 'op', 'del', 'id', eid, 'partition', f[4])
  return 1
end

-- delete up to `n` ids of sorted set `key`, oldest first, never `keep`; append them to `out`
local function evict(prefix, key, n, keep, out)
  if n <= 0 then return 0 end
  local done = 0
  for _, eid in ipairs(redis.call('ZRANGE', key, 0, n)) do
    if done < n and eid ~= keep and del(prefix, eid) == 1 then
      table.insert(out, eid)
      done = done + 1
    end
  end
  return done
end
"""

# ARGV: prefix, id, scope_id, exact_key, tenant, partition, last_used, expires_at ('' = none), max_entries,
#       max_entries_per_tenant, data_version, created_at, size, max_bytes_per_tenant ('' = none), then field/value
#       pairs of the entry hash (its `size` among them).
# Returns false (None) for an entry made before its tenant's data was bumped past its version.
_PUT = _DEL + """
local prefix, id, tenant = ARGV[1], ARGV[2], ARGV[5]
local bumped = redis.call('HGET', prefix .. 'bumpv', tenant)
if bumped and bumped ~= ARGV[11] and tonumber(redis.call('HGET', prefix .. 'bumpt', tenant)) > tonumber(ARGV[12]) then
  return false
end
local xk = prefix .. 'x:' .. ARGV[3] .. ':' .. ARGV[4]
local displaced = {}
local old = redis.call('GET', xk)
if old and old ~= id and del(prefix, old) == 1 then table.insert(displaced, old) end
del(prefix, id)  -- the same id written again: its old size and keys go first
local fields = {}
for i = 15, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', prefix .. 'e:' .. id, unpack(fields))
redis.call('HINCRBY', prefix .. 'bytes', tenant, ARGV[13])
redis.call('SET', xk, id)
redis.call('ZADD', prefix .. 'lru', ARGV[7], id)
if ARGV[8] ~= '' then redis.call('ZADD', prefix .. 'exp', ARGV[8], id) end
redis.call('SADD', prefix .. 't:' .. tenant, id)
if redis.call('ZADD', prefix .. 'l:' .. tenant, ARGV[7], id) == 1 then
  redis.call('ZINCRBY', prefix .. 'sizes', 1, tenant)
end
redis.call('XADD', prefix .. 'log', 'MAXLEN', '~', '100000', '*', 'op', 'put', 'id', id, 'partition', ARGV[6])
local own = prefix .. 'l:' .. tenant
evict(prefix, own, redis.call('ZCARD', own) - tonumber(ARGV[10]), id, displaced)
if ARGV[14] ~= '' then  -- the tenant's own least recently used, until its entries fit its byte budget
  local budget = tonumber(ARGV[14])
  while tonumber(redis.call('HGET', prefix .. 'bytes', tenant) or '0') > budget do
    if evict(prefix, own, 1, id, displaced) == 0 then break end
  end
end
local over = redis.call('ZCARD', prefix .. 'lru') - tonumber(ARGV[9])
while over > 0 do
  local largest = redis.call('ZREVRANGE', prefix .. 'sizes', 0, 0)[1]
  local done = 0
  if largest then done = evict(prefix, prefix .. 'l:' .. largest, over, id, displaced) end
  if done == 0 then done = evict(prefix, prefix .. 'lru', over, id, displaced) end  -- entries from before l:
  if done == 0 then break end
  over = over - done
end
return displaced
"""

_TOUCH = """
local tenant = redis.call('HGET', ARGV[1] .. 'e:' .. ARGV[2], 'tenant')
if not tenant then return 0 end
redis.call('ZADD', ARGV[1] .. 'lru', 'XX', ARGV[3], ARGV[2])
redis.call('ZADD', ARGV[1] .. 'l:' .. tenant, 'XX', ARGV[3], ARGV[2])
return 1
"""

_DELETE = _DEL + """
local gone = {}
for i = 2, #ARGV do
  if del(ARGV[1], ARGV[i]) == 1 then table.insert(gone, ARGV[i]) end
end
return gone
"""

_FIELDS = ("scope_id", "tenant", "data_version", "model_version", "exact_key", "partition", "semantic_text",
           "response", "usage", "metadata", "created_at", "expires_at", "last_used", "embedding")


class RedisStore(CacheStore):
    """Entries in one Redis, at most `max_entries` of them across all replicas, and `max_entries_per_tenant` and
    `max_bytes_per_tenant` (`stored_bytes`) of one tenant's (None: no bound of its own), LRU-evicted."""

    def __init__(self, url: str, *, max_entries: int = 100_000, max_entries_per_tenant: int | None = None,
                 max_bytes_per_tenant: int | None = MAX_BYTES_PER_TENANT, prefix: str = "tg:cache",
                 timeout_s: float = 1.0):
        check_bounds(max_entries, max_entries_per_tenant, max_bytes_per_tenant)
        self.max_entries = max_entries
        self.max_entries_per_tenant = max_entries_per_tenant or max_entries
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.prefix = prefix + ":"
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._put = self.redis.register_script(_PUT)
        self._delete = self.redis.register_script(_DELETE)
        self._touch = self.redis.register_script(_TOUCH)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RedisError as exc:
            raise CacheStoreError(f"redis: {exc}") from exc

    def __len__(self) -> int:
        return int(self._call(self.redis.zcard, self.prefix + "lru"))

    def put(self, entry: Entry) -> list[str] | None:
        size = stored_bytes(entry)
        if self.max_bytes_per_tenant is not None and size > self.max_bytes_per_tenant:
            return None  # larger than its tenant's whole budget: it would evict everything else and still be over
        blob = b"" if entry.embedding is None else np.asarray(entry.embedding, dtype=np.float32).tobytes()
        expires = "" if entry.expires_at is None else repr(entry.expires_at)
        values = {"scope_id": entry.scope_id, "tenant": entry.tenant, "data_version": entry.data_version,
                  "model_version": entry.model_version, "exact_key": entry.exact_key, "partition": entry.partition,
                  "semantic_text": entry.semantic_text, "response": entry.response, "usage": json.dumps(entry.usage),
                  "metadata": json.dumps(entry.metadata), "created_at": repr(entry.created_at),
                  "expires_at": expires, "last_used": repr(entry.last_used), "embedding": blob, "size": str(size)}
        flat: list[Any] = [x for kv in values.items() for x in kv]
        args = [self.prefix, entry.entry_id, entry.scope_id, entry.exact_key, entry.tenant, entry.partition,
                repr(entry.last_used), expires, self.max_entries, self.max_entries_per_tenant, entry.data_version,
                repr(entry.created_at), size,
                "" if self.max_bytes_per_tenant is None else self.max_bytes_per_tenant, *flat]
        displaced = self._call(self._put, keys=[], args=args)
        return None if displaced is None else [d.decode() for d in displaced]

    def get(self, entry_id: str) -> Entry | None:
        raw = self._call(self.redis.hgetall, self.prefix + "e:" + entry_id)
        return _entry(entry_id, raw) if raw else None

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        entry_id = self._call(self.redis.get, f"{self.prefix}x:{scope_id}:{exact_key}")
        return self.get(entry_id.decode()) if entry_id else None

    def touch(self, entry_id: str, now: float) -> None:
        self._call(self._touch, keys=[], args=[self.prefix, entry_id, repr(now)])

    def delete(self, entry_ids: Iterable[str]) -> list[str]:
        ids = list(entry_ids)
        gone: list[str] = []
        for start in range(0, len(ids), 500):
            gone += [d.decode() for d in self._call(self._delete, keys=[], args=[self.prefix, *ids[start:start + 500]])]
        return gone

    def _all_ids(self) -> list[str]:
        return [i.decode() for i in self._call(self.redis.zrange, self.prefix + "lru", 0, -1)]

    def _field(self, ids: list[str], field: str) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hget(self.prefix + "e:" + i, field)
        return [None if v is None else v.decode() for v in self._call(pipe.execute)]

    def ids_of_tenant(self, tenant: str | None, limit: int | None = None) -> list[str]:
        ids = self._all_ids() if tenant is None else \
            sorted(i.decode() for i in self._call(self.redis.smembers, self.prefix + "t:" + tenant))
        return ids[:limit] if limit else ids

    def ids_not_at_data_version(self, tenant: str, data_version: str, created_before: float, limit: int) -> list[str]:
        ids = self.ids_of_tenant(tenant)
        versions, created = self._field(ids, "data_version"), self._field(ids, "created_at")
        return [i for i, v, c in zip(ids, versions, created, strict=True)
                if v is not None and c is not None and v != data_version and float(c) < created_before][:limit]

    def drop_data_versions(self, tenant: str, current: str, created_before: float, batch: int = 500) -> list[str]:
        """One pass over the tenant's entries (the batched default rescans them for every batch), once the bump is
        recorded for `put`: a write after it is refused, one before it is in the pass."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.prefix + "bumpv", tenant, current)
        pipe.hset(self.prefix + "bumpt", tenant, repr(created_before))
        self._call(pipe.execute)
        return self.delete(self.ids_not_at_data_version(tenant, current, created_before, 1 << 62))

    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]:
        ids = self._all_ids()  # O(entries): reclaim of a retired model is rare and runs in batches
        return [i for i, v in zip(ids, self._field(ids, "model_version"), strict=True) if v == model_version][:limit]

    def model_versions(self) -> set[str]:
        return {v for v in self._field(self._all_ids(), "model_version") if v is not None}

    def expired(self, now: float, limit: int = 1000) -> list[str]:
        return [i.decode() for i in self._call(self.redis.zrangebyscore, self.prefix + "exp", "-inf", now,
                                               start=0, num=limit)]

    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        ids = self._all_ids()
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(self.prefix + "e:" + i, "partition", "embedding")
        for entry_id, (partition, blob) in zip(ids, self._call(pipe.execute), strict=True):
            if partition is not None and blob:
                yield entry_id, partition.decode(), np.frombuffer(blob, dtype=np.float32)

    def vectors_of(self, entry_ids: Iterable[str]) -> list[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of those of `entry_ids` stored with an embedding, in their order: what
        another replica's write adds to this one's index (cache/entry_writes.py), one pipeline of HMGETs per 500
        ids, and none of the entries' texts."""
        ids = list(dict.fromkeys(entry_ids))
        out: list[tuple[str, str, np.ndarray]] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            pipe = self.redis.pipeline(transaction=False)
            for i in chunk:
                pipe.hmget(self.prefix + "e:" + i, "partition", "embedding")
            for entry_id, (partition, blob) in zip(chunk, self._call(pipe.execute), strict=True):
                if partition is not None and blob:
                    out.append((entry_id, partition.decode(), np.frombuffer(blob, dtype=np.float32)))
        return out

    def change_cursor(self) -> str:
        last = self._call(self.redis.xrevrange, self.prefix + "log", count=1)
        return last[0][0].decode() if last else "0-0"

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[tuple[str, str, str]]]:
        """As `CacheStore.changes_since`. The log is trimmed to about 100,000 events (and is gone with a Redis that
        came back empty): a process whose cursor's own event is no longer in it may have missed others after it (a
        deletion its map of recent entries would go on serving, a write its index would never propose), so it gets
        a 'reset' and reloads every vector, as the SQLite store's log says when trimmed past a cursor."""
        cursor = cursor or "0-0"
        # from the cursor's own event on (inclusive), while the log still holds it: proof that nothing after it was cut
        rows = self._call(self.redis.xrange, self.prefix + "log", cursor, "+", count=limit + 1)
        if cursor != "0-0":
            if not rows or rows[0][0].decode() != cursor:
                return self.change_cursor(), [("reset", "", "")]  # the cursor read first: nothing after it missed
            rows = rows[1:]
        rows = rows[:limit]
        changes = [(f[b"op"].decode(), f[b"id"].decode(), f[b"partition"].decode()) for _, f in rows]
        return (rows[-1][0].decode() if rows else cursor), changes

    def close(self) -> None:
        self.redis.close()


def _entry(entry_id: str, raw: dict[bytes, bytes]) -> Entry:
    f = {k.decode(): v for k, v in raw.items()}
    text = {k: v.decode() for k, v in f.items() if k != "embedding"}
    blob = f.get("embedding", b"")
    return Entry(entry_id=entry_id, scope_id=text["scope_id"], tenant=text["tenant"],
                 data_version=text["data_version"], model_version=text["model_version"],
                 exact_key=text["exact_key"], partition=text["partition"], semantic_text=text["semantic_text"],
                 response=text["response"], usage=json.loads(text["usage"]), metadata=json.loads(text["metadata"]),
                 created_at=float(text["created_at"]),
                 expires_at=float(text["expires_at"]) if text["expires_at"] else None,
                 last_used=float(text["last_used"]), embedding=np.frombuffer(blob, dtype=np.float32) if blob else None)
