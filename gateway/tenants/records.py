"""What the tenant store holds and hands out: `Tenant`, `ApiKey`, `Principal`, and how a stored key row becomes an
`ApiKey` (`KEY_COLUMNS`, `key_from_row`). Plain values: no queries, no rules (gateway/tenants/rules.py has those)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal

from quotas.plans import Limits

ADMIN = "admin"
BUDGET_FIELDS = ("budget_day_usd", "budget_month_usd")  # strings of exact dollars, as stored


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


KEY_COLUMNS = "key_id, tenant, name, roles, created_at, expires_at, revoked_at, replaced_by, limits"


def key_from_row(row: tuple) -> ApiKey:  # type: ignore[type-arg]
    """The key a row of `KEY_COLUMNS` holds."""
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
