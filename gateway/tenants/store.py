"""Tenants and API keys in SQLite (WAL), shared by the running gateway and the CLI.

The gateway keeps a read cache of keys; SQLite's `PRAGMA data_version` changes whenever another
connection (the CLI, another gateway process) commits, so a revocation takes effect on the next request
without a query per request.

Key rules the store enforces, whichever door a key comes through (admin API, CLI, bootstrap): an admin key
belongs to no tenant (one key never both calls models and administers); every expiry is finite and at most
`MAX_TTL_S` ahead; a rotation never lets either key outlive the one it replaces.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.tenants.keys import MAX_GRACE_S, MAX_TTL_S, check_seconds, hash_secret, new_key, parse_key, verify
from quotas.plans import Limits

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
ADMIN = "admin"

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    plan TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT REFERENCES tenants(name),
    name TEXT NOT NULL DEFAULT '',
    key_sha256 TEXT NOT NULL,
    roles TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL,
    replaced_by TEXT,
    limits TEXT
);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys(tenant);
CREATE TABLE IF NOT EXISTS tenant_data_versions (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name),
    version INTEGER NOT NULL
);
"""


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


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class TenantStore:
    def __init__(self, path: Path) -> None:
        self._conn = connect(path)
        self._conn.executescript(SCHEMA)
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(api_keys)")}
        if "limits" not in columns:  # a data directory from before per-key limits
            self._conn.execute("ALTER TABLE api_keys ADD COLUMN limits TEXT")
        self._cache: dict[str, tuple[str, ApiKey, Tenant | None]] = {}
        self._versions: dict[str, int] = {}
        self._version = self._data_version()

    def close(self) -> None:
        self._conn.close()

    # ---- tenants ----

    def create_tenant(self, name: str, plan: str) -> Tenant:
        if not NAME_RE.match(name):
            raise InvalidRequest("tenant names are 1-64 characters of a-z, 0-9, '.', '_' and '-'",
                                 param="name")
        tenant = Tenant(name, plan, time.time())
        try:
            self._conn.execute("INSERT INTO tenants(name, plan, created_at) VALUES (?, ?, ?)",
                               (tenant.name, tenant.plan, tenant.created_at))
        except sqlite3.IntegrityError as exc:
            raise Conflict(f"tenant {name!r} already exists", param="name", code="tenant_exists") from exc
        return tenant

    def get_tenant(self, name: str) -> Tenant:
        row = self._conn.execute("SELECT name, plan, created_at FROM tenants WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(f"no tenant {name!r}", param="tenant", code="tenant_not_found")
        return Tenant(*row)

    def list_tenants(self) -> list[Tenant]:
        return [Tenant(*r) for r in self._conn.execute("SELECT name, plan, created_at FROM tenants ORDER BY name")]

    def data_version(self, tenant: str) -> int:
        """The tenant's data version: cached answers from an older one are never served."""
        if tenant not in self._versions:  # cleared with the key cache whenever anyone writes
            row = self._conn.execute("SELECT version FROM tenant_data_versions WHERE tenant = ?", (tenant,)).fetchone()
            self._versions[tenant] = int(row[0]) if row else 0
        return self._versions[tenant]

    def bump_data_version(self, tenant: str) -> int:
        """The tenant's data changed: a new version, which makes every cached answer of theirs unreachable."""
        self.get_tenant(tenant)
        self._conn.execute("INSERT INTO tenant_data_versions(tenant, version) VALUES (?, 1) "
                           "ON CONFLICT(tenant) DO UPDATE SET version = version + 1", (tenant,))
        self._invalidate()
        return self.data_version(tenant)

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
            self.get_tenant(tenant)
        key_id, plaintext = new_key()
        key = ApiKey(key_id, tenant, name, roles, now, expires_at, None, None, limits)
        self._conn.execute(
            "INSERT INTO api_keys(key_id, tenant, name, key_sha256, roles, created_at, expires_at, limits) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key.key_id, key.tenant, key.name, hash_secret(plaintext), json.dumps(list(key.roles)),
             key.created_at, key.expires_at, limits.model_dump_json(exclude_none=True) if limits else None))
        self._invalidate()
        return key, plaintext

    def get_key(self, key_id: str) -> ApiKey:
        row = self._conn.execute(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        if row is None:
            raise NotFound(f"no key {key_id!r}", param="key_id", code="key_not_found")
        return _key(row)

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            rows = self._conn.execute(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at")
        else:
            rows = self._conn.execute(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE tenant = ? ORDER BY created_at",
                                      (tenant,))
        return [_key(r) for r in rows]

    def revoke_key(self, key_id: str) -> ApiKey:
        key = self.get_key(key_id)
        if key.revoked_at is None:
            self._conn.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (time.time(), key_id))
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
        self._conn.execute("BEGIN IMMEDIATE")  # two rotations of one key: the second sees the first's result
        try:
            old = self.get_key(key_id)
            now = time.time()
            if not old.active(now):
                raise Conflict(f"key {key_id!r} is revoked or expired; issue a new one", code="key_inactive")
            # a key from before expiries were bounded is brought within the bound, never past its own end
            cap = now + MAX_TTL_S if old.expires_at is not None else None
            expires_at = _earliest(old.expires_at, cap, now + ttl_s if ttl_s is not None else None)
            new, plaintext = self.issue_key(old.tenant, name=old.name, roles=old.roles, expires_at=expires_at,
                                            limits=old.limits)
            if grace_s > 0:
                self._conn.execute("UPDATE api_keys SET expires_at = ?, replaced_by = ? WHERE key_id = ?",
                                   (_earliest(old.expires_at, now + grace_s), new.key_id, key_id))
            else:
                self._conn.execute("UPDATE api_keys SET revoked_at = ?, replaced_by = ? WHERE key_id = ?",
                                   (now, new.key_id, key_id))
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._invalidate()
        return new, plaintext

    def authenticate(self, presented: str) -> Principal | None:
        """The principal for a presented key, or None (unknown, wrong secret, revoked, expired)."""
        parsed = parse_key(presented)
        key_id = parsed[0] if parsed else ""
        if self._data_version() != self._version:
            self._invalidate()
        entry = self._cache.get(key_id) if parsed else None
        if entry is None and parsed:
            entry = self._load(key_id)
        if not verify(presented, entry[0] if entry else None) or entry is None:
            return None
        _, key, tenant = entry
        if not key.active(time.time()):
            return None
        return Principal(key, tenant)

    def _load(self, key_id: str) -> tuple[str, ApiKey, Tenant | None] | None:
        row = self._conn.execute(f"SELECT key_sha256, {_KEY_COLUMNS} FROM api_keys WHERE key_id = ?",
                                 (key_id,)).fetchone()
        if row is None:
            return None
        key = _key(row[1:])
        tenant = self.get_tenant(key.tenant) if key.tenant else None
        self._cache[key_id] = (row[0], key, tenant)
        return self._cache[key_id]

    def _data_version(self) -> int:
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def _invalidate(self) -> None:
        self._cache.clear()
        self._versions.clear()
        self._version = self._data_version()


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
                  Limits.model_validate_json(limits) if limits else None)
