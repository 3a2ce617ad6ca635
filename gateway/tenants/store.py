"""Tenants, API keys (hashes) and data versions: the store's interface, its reads and its writes.

Two stores behind one interface, `TenantStore`: `SQLiteTenantStore` (gateway/tenants/store_sqlite.py, WAL, in
the data directory, shared by the gateway processes of one host and the CLI) and `PostgresTenantStore`
(gateway/tenants/store_postgres.py, the fleet database, shared by replicas on any number of hosts).
`TenantStore(path)` opens the embedded one, as `pathlib.Path(...)` picks its flavour. The rules live in the
base class and gateway/tenants/rules.py; an implementation supplies statements (written with `?` placeholders), one
exclusive transaction, and how it learns that another connection committed.

The gateway keeps a read cache of keys and data versions, so a request costs no query, emptied whenever anyone commits
a change (`ReadCache`, gateway/tenants/read_cache.py, says how); the records the store hands out are
gateway/tenants/records.py's.

The admin routes call the store through `admin`: on a thread of the store's own, one call at a time, with a
connection of that thread's own where the store's connection is one (SQLite). A write waits there for another
writer's lock (the CLI, another process: SQLite's busy timeout, PostgreSQL's statement timeout, seconds), while the
loop goes on serving every tenant.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.tenants.keys import hash_secret, new_key, parse_key
from gateway.tenants.read_cache import ReadCache, _Entry
from gateway.tenants.records import KEY_COLUMNS, ApiKey, Tenant, key_from_row
from gateway.tenants.rules import (
    check_new_key,
    check_tenant_name,
    earliest,
    new_key_expiry,
    one_line,
    replacement_expiry,
    rotation_spans,
)
from quotas.plans import Limits

P = ParamSpec("P")
T = TypeVar("T")


class TenantStore(ReadCache):
    """The tenant store's interface and rules; see the module docstring for what an implementation supplies."""

    _conflict: tuple[type[Exception], ...] = ()  # the driver's errors for a duplicate name

    def __new__(cls, *args: Any, **kwargs: Any) -> TenantStore:
        if cls is TenantStore:  # `TenantStore(path)`: the embedded SQLite store
            from gateway.tenants.store_sqlite import SQLiteTenantStore

            cls = SQLiteTenantStore
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        self._admin_thread: ThreadPoolExecutor | None = None  # `admin`'s, started on its first call

    # ---- what an implementation supplies (and `_changed_elsewhere`, the read cache's) ----

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
        check_tenant_name(name)
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
            raise NotFound(f"no tenant {name[:128]!r}", param="tenant", code="tenant_not_found")
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
        check_new_key(tenant, name, roles)
        now = time.time()
        expires_at = new_key_expiry(now, ttl_s, expires_at)
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
        row = self._fetchone(f"SELECT {KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        if row is None:
            whole = parse_key(key_id)  # a whole key pasted where its id goes: never echo its secret
            raise NotFound(f"no key {key_id[:128]!r}" if whole is None else
                           f"no key with that id: give a key's id ({whole[0]!r} in that key), not the key itself",
                           param="key_id", code="key_not_found")
        return key_from_row(row)

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            rows = self._fetchall(f"SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at")
        else:
            rows = self._fetchall(f"SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant = ? ORDER BY created_at",
                                  (tenant,))
        return [key_from_row(r) for r in rows]

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
        grace_s, ttl_s = rotation_spans(grace_s, ttl_s)
        with self._exclusive():
            old = self.get_key(key_id)
            now = time.time()
            if not old.active(now):
                raise Conflict(f"key {key_id[:128]!r} is revoked or expired; issue a new one", code="key_inactive")
            expires_at = replacement_expiry(old.expires_at, now, ttl_s)
            new, plaintext = self.issue_key(old.tenant, name=one_line(old.name), roles=old.roles,
                                            expires_at=expires_at, limits=old.limits)
            if grace_s > 0:
                self._execute("UPDATE api_keys SET expires_at = ?, replaced_by = ? WHERE key_id = ?",
                              (earliest(old.expires_at, now + grace_s), new.key_id, key_id))
            else:
                self._execute("UPDATE api_keys SET revoked_at = ?, replaced_by = ? WHERE key_id = ?",
                              (now, new.key_id, key_id))
        self._invalidate()
        return new, plaintext

    # ---- the reads the read cache keeps ----

    def _fetch_version(self, tenant: str) -> int:
        """The tenant's data version as stored (0 before its first bump): a query only (any thread may run it)."""
        row = self._fetchone("SELECT version FROM tenant_data_versions WHERE tenant = ?", (tenant,))
        return int(row[0]) if row else 0

    def _fetch_entry(self, key_id: str) -> _Entry | None:
        """The key's stored hash, the key and its tenant, or None: queries only (any thread may run them)."""
        row = self._fetchone(f"SELECT key_sha256, {KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        if row is None:
            return None
        key = key_from_row(row[1:])
        return row[0], key, self.get_tenant(key.tenant) if key.tenant else None
