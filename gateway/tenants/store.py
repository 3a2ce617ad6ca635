"""Tenants, API keys (hashes) and data versions: the store's interface and the rules every store enforces.

Two stores behind one interface, `TenantStore`: `SQLiteTenantStore` (gateway/tenants/store_sqlite.py, WAL, in
the data directory, shared by the gateway processes of one host and the CLI) and `PostgresTenantStore`
(gateway/tenants/store_postgres.py, the fleet database, shared by replicas on any number of hosts).
`TenantStore(path)` opens the embedded one, as `pathlib.Path(...)` picks its flavour. The rules live in the
base class; an implementation supplies statements (written with `?` placeholders), one exclusive
transaction, and how it learns that another connection committed.

The gateway keeps a read cache of keys and data versions, so a request costs no query. It is emptied
whenever anyone commits a change: SQLite's `PRAGMA data_version` changes when another connection (the CLI,
another gateway process) commits, so a revocation takes effect on the next request; PostgreSQL's replicas
hear of each change through LISTEN/NOTIFY and a change counter, within milliseconds (a second at most). A key
id not cached (a key's first use, or one made up: no key is needed to send one) is looked up by
`authenticate_async` off the event loop wherever that query waits on a network (PostgreSQL), so a flood of
made-up ids never stalls the loop that serves everyone else. So is a tenant's data version not cached
(`data_version_async`, the cache stage's): every write empties every tenant's, and each reads it again.

The admin routes call the store through `admin`: on a thread of the store's own, one call at a time, with a
connection of that thread's own where the store's connection is one (SQLite). A write waits there for another
writer's lock (the CLI, another process: SQLite's busy timeout, PostgreSQL's statement timeout, seconds), while the
loop goes on serving every tenant.

Key rules the store enforces, whichever door a key comes through (admin API, CLI, bootstrap): an admin key
belongs to no tenant (one key never both calls models and administers); every expiry is finite and at most
`MAX_TTL_S` ahead; a rotation never lets either key outlive the one it replaces.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ParamSpec, TypeVar

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.tenants.keys import MAX_GRACE_S, MAX_TTL_S, check_seconds, hash_secret, new_key, parse_key, verify
from quotas.plans import Limits

BUDGET_FIELDS = ("budget_day_usd", "budget_month_usd")  # strings of exact dollars, as stored

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
ADMIN = "admin"
# a key's name (a label) is one line of `tiergate keys list`'s tab-separated table and of the admin API's answers: no
# tab, newline or other C0 or C1 control, nor Unicode's line and paragraph separators (a name holding "\n<id>\tacme\t
# active" printed a row for a key that does not exist), at most 128 characters
KEY_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]{0,128}$"
_KEY_NAME = re.compile(KEY_NAME_PATTERN)
MAX_CACHED = 100_000  # cached key ids of each kind (keys, unknown ids); past it that cache starts again (bounded)

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Tenant:
    name: str
    plan: str
    created_at: float


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str | None  # None for admin keys
    name: str
    roles: tuple[str, ...]
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    replaced_by: str | None
    limits: Limits | None = None  # this key's own limits, on top of its tenant's plan

    @property
    def is_admin(self) -> bool:
        """Only a tenantless key administers (a row bound to a tenant from before that rule does not)."""
        return ADMIN in self.roles and self.tenant is None

    def active(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def public(self) -> dict[str, object]:
        """What the admin API and the CLI may show: never the secret or its hash."""
        return {"key_id": self.key_id, "tenant": self.tenant, "name": self.name, "roles": list(self.roles),
                "created_at": self.created_at, "expires_at": self.expires_at, "revoked_at": self.revoked_at,
                "replaced_by": self.replaced_by,
                "limits": self.limits.model_dump(mode="json", exclude_none=True) if self.limits else None}


@dataclass(frozen=True)
class Principal:
    """Who is asking: the key, and the tenant it belongs to (None for an admin key)."""

    key: ApiKey
    tenant: Tenant | None


_Entry = tuple[str, ApiKey, Tenant | None]  # a key's stored hash, the key, its tenant
_MISS = object()  # `_cached`'s answer for a key id it holds no answer for


class TenantStore(ABC):
    """The tenant store's interface and rules; see the module docstring for what an implementation supplies."""

    _conflict: tuple[type[Exception], ...] = ()  # the driver's errors for a duplicate name

    def __new__(cls, *args: Any, **kwargs: Any) -> TenantStore:
        if cls is TenantStore:  # `TenantStore(path)`: the embedded SQLite store
            from gateway.tenants.store_sqlite import SQLiteTenantStore

            cls = SQLiteTenantStore
        return super().__new__(cls)

    def __init__(self) -> None:
        # by key id: the keys there are, and apart from them the ids of none, so that a flood of made-up ids
        # (no key needed to send one) empties only its own cache, never the real keys' (each a query again)
        self._cache: dict[str, _Entry] = {}
        self._unknown: dict[str, None] = {}
        self._versions: dict[str, int] = {}
        self._generation = 0  # bumped at each emptying, so a read that raced one is not cached
        self._admin_thread: ThreadPoolExecutor | None = None  # `admin`'s, started on its first call

    # ---- what an implementation supplies ----

    @abstractmethod
    def _fetchone(self, sql: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None: ...

    @abstractmethod
    def _fetchall(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    @abstractmethod
    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> None: ...

    @abstractmethod
    def _exclusive(self) -> AbstractContextManager[None]:
        """A transaction no other writer runs beside (two rotations of one key: the second sees the first)."""

    @abstractmethod
    def _changed_elsewhere(self) -> bool:
        """Whether another connection committed since this was last asked (True when it cannot tell)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connections; an implementation calls `_close_admin` first."""

    def _as_admin(self, action: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `action` on the admin thread: a store whose connection is one gives the thread its own, and may turn
        its driver's errors into ours here; a store with a pool (PostgreSQL) lends the thread its connections."""
        return action(*args, **kwargs)

    # ---- the admin routes' calls ----

    async def admin(self, action: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`action(*args, **kwargs)`, one of this store's methods (or a function of them), for the event loop: run on
        the store's admin thread, one call at a time, while the loop serves everyone else. A write that waits for
        another writer's lock waits there, never on the loop. A call that has started runs whole (a transaction,
        where the method has one), even if its caller leaves."""
        generation = self._generation
        if self._admin_thread is None:
            self._admin_thread = ThreadPoolExecutor(1, thread_name_prefix="tenant-admin")
        call = functools.partial(self._as_admin, action, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._admin_thread, call)
        finally:
            if generation != self._generation:  # it wrote: what the loop cached meanwhile is dropped as well
                self._invalidate()

    def _close_admin(self) -> None:
        if self._admin_thread is not None:
            self._admin_thread.shutdown(wait=True, cancel_futures=True)

    # ---- tenants ----

    def create_tenant(self, name: str, plan: str) -> Tenant:
        if not NAME_RE.fullmatch(name):  # `match` let a final newline through: `$` matches before one
            raise InvalidRequest("tenant names are 1-64 characters of a-z, 0-9, '.', '_' and '-'",
                                 param="name")
        tenant = Tenant(name, plan, time.time())
        try:
            self._execute("INSERT INTO tenants(name, plan, created_at) VALUES (?, ?, ?)",
                          (tenant.name, tenant.plan, tenant.created_at))
        except self._conflict as exc:
            raise Conflict(f"tenant {name!r} already exists", param="name", code="tenant_exists") from exc
        self._invalidate()
        return tenant

    def set_plan(self, name: str, plan: str) -> Tenant:
        """Move tenant NAME to another plan; every replica's requests follow it within a second."""
        self.get_tenant(name)
        self._execute("UPDATE tenants SET plan = ? WHERE name = ?", (plan, name))
        self._invalidate()
        return self.get_tenant(name)

    def get_tenant(self, name: str) -> Tenant:
        row = self._fetchone("SELECT name, plan, created_at FROM tenants WHERE name = ?", (name,))
        if row is None:
            raise NotFound(f"no tenant {name!r}", param="tenant", code="tenant_not_found")
        return Tenant(*row)

    def require_tenant(self, name: str, param: str) -> None:
        """A 400 naming `param` if the store has no tenant `name`: what an admin names in a body (a key's tenant, a
        canary's tenants) must exist, or a misspelt name is taken and names no one. A 400, not a 404: the route
        exists, and the name is bad input in the body, as any other field's bad value is."""
        if self._fetchone("SELECT 1 FROM tenants WHERE name = ?", (name,)) is None:
            raise InvalidRequest(f"{param}: no tenant {name[:64]!r}", param=param, code="tenant_not_found")

    def require_tenants(self, names: Iterable[str], param: str) -> None:
        """`require_tenant` for each of `names`: the first the store does not have is named `param`.index."""
        for i, name in enumerate(names):
            self.require_tenant(name, f"{param}.{i}")

    def list_tenants(self) -> list[Tenant]:
        return [Tenant(*r) for r in self._fetchall("SELECT name, plan, created_at FROM tenants ORDER BY name")]

    def data_version(self, tenant: str, *, follow: bool = True) -> int:
        """The tenant's data version: cached answers from an older one are never served. `follow=False` skips
        asking whether another connection committed, for a caller that just did. A version not cached is a query on
        the calling thread: from the event loop, `data_version_async` is the one to call."""
        if follow:
            self._follow()
        version = self._versions.get(tenant)  # emptied with the key cache whenever anyone writes
        return self._load_version(tenant) if version is None else version

    async def data_version_async(self, tenant: str) -> int:
        """`data_version` for the event loop, without following (the request's `authenticate_async` just did): a
        cached version costs no await; one not cached is `_version_lookup`'s, which a store whose queries wait on a
        network runs off the loop. Any write empties every tenant's cached version, so after each one every tenant's
        next cacheable request asks: on the loop, one waiting on a lock (seconds) stalled every tenant's requests."""
        version = self._versions.get(tenant)
        return await self._version_lookup(tenant) if version is None else version

    async def _version_lookup(self, tenant: str) -> int:
        """A version not cached, read for the event loop: here on it (SQLite's query is local, ~0.1 ms)."""
        return self._load_version(tenant)

    def _load_version(self, tenant: str) -> int:
        generation = self._generation
        version = self._fetch_version(tenant)
        self._keep_version(tenant, version, generation)
        return version

    def _fetch_version(self, tenant: str) -> int:
        """The tenant's data version as stored (0 before its first bump): a query only (any thread may run it)."""
        row = self._fetchone("SELECT version FROM tenant_data_versions WHERE tenant = ?", (tenant,))
        return int(row[0]) if row else 0

    def _keep_version(self, tenant: str, version: int, generation: int) -> None:
        """Cache a version read, unless someone committed since the read began (`generation` is from then): it may
        be older than theirs."""
        if generation == self._generation:
            if len(self._versions) >= MAX_CACHED:
                self._versions.clear()
            self._versions[tenant] = version

    def bump_data_version(self, tenant: str) -> int:
        """The tenant's data changed: a new version, which makes every cached answer of theirs unreachable."""
        self.get_tenant(tenant)
        self._execute("INSERT INTO tenant_data_versions(tenant, version) VALUES (?, 1) "
                      "ON CONFLICT(tenant) DO UPDATE SET version = tenant_data_versions.version + 1", (tenant,))
        self._invalidate()
        return self._fetch_version(tenant)  # read, not cached: this may run on the admin thread

    # ---- keys ----

    def issue_key(self, tenant: str | None, *, name: str = "", roles: tuple[str, ...] | str = (),
                  ttl_s: float | None = None, expires_at: float | None = None,
                  limits: Limits | None = None) -> tuple[ApiKey, str]:
        """Create a key that expires after `ttl_s` (or at `expires_at`, or never); returns it and its plaintext,
        which is never stored or shown again."""
        roles = (roles,) if isinstance(roles, str) else tuple(roles)
        if tenant is not None and any(r.strip().casefold() == ADMIN for r in roles):
            raise InvalidRequest("an admin key cannot belong to a tenant: issue a tenant key and a separate admin "
                                 "key", param="tenant", code="admin_key_with_tenant")
        if tenant is None and ADMIN not in roles:
            raise InvalidRequest("a key without a tenant must be an admin key", param="tenant")
        if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
            raise InvalidRequest("name: at most 128 characters on one line, without tabs or other control characters",
                                 param="name", code="invalid_value")
        now = time.time()
        if ttl_s is not None:
            if expires_at is not None:
                raise InvalidRequest("give a time to live or an expiry time, not both", param="ttl_s")
            expires_at = now + _seconds(ttl_s, "ttl_s", MAX_TTL_S)
        elif expires_at is not None and not (isinstance(expires_at, int | float)
                                             and now < expires_at <= now + MAX_TTL_S):  # NaN fails both
            raise InvalidRequest(f"expires_at: must be a time in the future, at most {MAX_TTL_S / 86400:.0f} days "
                                 "ahead", param="expires_at", code="invalid_duration")
        if tenant is not None:
            self.require_tenant(tenant, "tenant")  # a 400: the caller named it, in a body or a CLI option
        key_id, plaintext = new_key()
        key = ApiKey(key_id, tenant, name, roles, now, expires_at, None, None, limits)
        self._execute(
            "INSERT INTO api_keys(key_id, tenant, name, key_sha256, roles, created_at, expires_at, limits) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key.key_id, key.tenant, key.name, hash_secret(plaintext), json.dumps(list(key.roles)),
             key.created_at, key.expires_at, limits.model_dump_json(exclude_none=True) if limits else None))
        self._invalidate()
        return key, plaintext

    def get_key(self, key_id: str) -> ApiKey:
        row = self._fetchone(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        if row is None:
            whole = parse_key(key_id)  # a whole key pasted where its id goes: never echo its secret
            raise NotFound(f"no key {key_id!r}" if whole is None else
                           f"no key with that id: give a key's id ({whole[0]!r} in that key), not the key itself",
                           param="key_id", code="key_not_found")
        return _key(row)

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            rows = self._fetchall(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at")
        else:
            rows = self._fetchall(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE tenant = ? ORDER BY created_at",
                                  (tenant,))
        return [_key(r) for r in rows]

    def revoke_key(self, key_id: str) -> ApiKey:
        key = self.get_key(key_id)
        if key.revoked_at is None:
            self._execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (time.time(), key_id))
            self._invalidate()
        return self.get_key(key_id)

    def rotate_key(self, key_id: str, *, grace_s: float = 0.0, ttl_s: float | None = None) -> tuple[ApiKey, str]:
        """Issue a replacement with the same tenant, roles and limits; the old key ends after `grace_s`.

        Rotation replaces a secret, it does not renew a lease: the new key expires after `ttl_s` or when the old
        one would have, whichever is first (a key without expiry may be given one), and the grace period never
        outlives the old key's own expiry.
        """
        grace_s = _seconds(grace_s, "grace_s", MAX_GRACE_S, allow_zero=True)
        if ttl_s is not None:
            ttl_s = _seconds(ttl_s, "ttl_s", MAX_TTL_S)
        with self._exclusive():
            old = self.get_key(key_id)
            now = time.time()
            if not old.active(now):
                raise Conflict(f"key {key_id!r} is revoked or expired; issue a new one", code="key_inactive")
            # a key from before expiries were bounded is brought within the bound, never past its own end
            cap = now + MAX_TTL_S if old.expires_at is not None else None
            expires_at = _earliest(old.expires_at, cap, now + ttl_s if ttl_s is not None else None)
            new, plaintext = self.issue_key(old.tenant, name=_one_line(old.name), roles=old.roles,
                                            expires_at=expires_at, limits=old.limits)
            if grace_s > 0:
                self._execute("UPDATE api_keys SET expires_at = ?, replaced_by = ? WHERE key_id = ?",
                              (_earliest(old.expires_at, now + grace_s), new.key_id, key_id))
            else:
                self._execute("UPDATE api_keys SET revoked_at = ?, replaced_by = ? WHERE key_id = ?",
                              (now, new.key_id, key_id))
        self._invalidate()
        return new, plaintext

    def authenticate(self, presented: str) -> Principal | None:
        """The principal for a presented key, or None (unknown, wrong secret, revoked, expired). A key id not
        cached is a query on the calling thread: from the event loop, `authenticate_async` is the one to call."""
        parsed = parse_key(presented)
        entry = self._cached(parsed)
        if entry is _MISS:
            entry = self._load(parsed[0])  # type: ignore[index]
        return _principal(presented, entry)  # type: ignore[arg-type]

    async def authenticate_async(self, presented: str) -> Principal | None:
        """`authenticate` for the event loop: a cached key costs no await; a key id not cached is `_lookup`'s,
        which a store whose queries wait on a network runs off the loop (anyone can send a made-up id)."""
        parsed = parse_key(presented)
        entry = self._cached(parsed)
        if entry is _MISS:
            entry = await self._lookup(parsed[0])  # type: ignore[index]
        return _principal(presented, entry)  # type: ignore[arg-type]

    def _cached(self, parsed: tuple[str, str] | None) -> _Entry | object | None:
        """The cached entry of a parsed key, None when it is known not to exist, `_MISS` when not cached."""
        self._follow()
        if not parsed:
            return None
        entry = self._cache.get(parsed[0])
        return _MISS if entry is None and parsed[0] not in self._unknown else entry

    async def _lookup(self, key_id: str) -> _Entry | None:
        """A key id not cached, looked up for the event loop: here on it (SQLite's query is local, ~0.1 ms)."""
        return self._load(key_id)

    def _load(self, key_id: str) -> _Entry | None:
        generation = self._generation
        entry = self._fetch_entry(key_id)
        self._keep(key_id, entry, generation)
        return entry

    def _fetch_entry(self, key_id: str) -> _Entry | None:
        """The key's stored hash, the key and its tenant, or None: queries only (any thread may run them)."""
        row = self._fetchone(f"SELECT key_sha256, {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        if row is None:
            return None
        key = _key(row[1:])
        return row[0], key, self.get_tenant(key.tenant) if key.tenant else None

    def _keep(self, key_id: str, entry: _Entry | None, generation: int) -> None:
        """Cache what a lookup found, unless someone committed since it began (`generation` is from then)."""
        if generation == self._generation:
            cache: dict[str, Any] = self._cache if entry is not None else self._unknown
            if len(cache) >= MAX_CACHED:
                cache.clear()
            cache[key_id] = entry

    def _follow(self) -> None:
        """Empty the caches if another connection (the CLI, another process or replica) committed a change."""
        if self._changed_elsewhere():
            self._invalidate()

    def _invalidate(self) -> None:
        self._generation += 1
        self._cache.clear()
        self._unknown.clear()
        self._versions.clear()


def _principal(presented: str, entry: _Entry | None) -> Principal | None:
    """The principal if `presented` is the entry's key and the key is active. The hash is compared whatever the
    entry (constant time; an unknown id costs what a wrong secret does)."""
    if not verify(presented, entry[0] if entry else None) or entry is None:
        return None
    _, key, tenant = entry
    return Principal(key, tenant) if key.active(time.time()) else None


def _one_line(name: str) -> str:
    """A name issued before KEY_NAME_PATTERN, as its replacement's: each control a space, cut at 128 characters."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", " ", name)[:128]


def _seconds(value: object, param: str, maximum: float, *, allow_zero: bool = False) -> float:
    """`value` checked as a finite span of seconds, or a 400 naming `param`."""
    try:
        return check_seconds(value, maximum=maximum, allow_zero=allow_zero)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param, code="invalid_duration") from exc


def _earliest(*times: float | None) -> float | None:
    """The first of the given instants; None (never) only when all are None."""
    return min((t for t in times if t is not None), default=None)


_KEY_COLUMNS = "key_id, tenant, name, roles, created_at, expires_at, revoked_at, replaced_by, limits"


def _key(row: tuple) -> ApiKey:  # type: ignore[type-arg]
    key_id, tenant, name, roles, created_at, expires_at, revoked_at, replaced_by, limits = row
    return ApiKey(key_id, tenant, name, tuple(json.loads(roles)), created_at, expires_at, revoked_at, replaced_by,
                  _stored_limits(limits) if limits else None)


def _stored_limits(text: str) -> Limits:
    """A key's limits as the store holds them. A budget written before budgets were written as plain digits may be
    in a Decimal's exponent form (`1E-7`, or 1e308's digits), which the API's rule refuses: read as the exact Decimal
    it was written from, never refused (that key, and every listing of keys, answered 500) and never dropped (that
    would lift its budget)."""
    data = json.loads(text)
    for name in BUDGET_FIELDS:
        if isinstance(data.get(name), str):
            data[name] = Decimal(data[name])
    return Limits.stored(data)  # above today's maxima too: what it was issued with
