"""The rules the tenant store enforces on what it is given, whichever door it comes through (admin API, CLI,
bootstrap): each a 400 naming the field it refuses, with a code (`POST /admin/keys {}` had none: `code: null`).

Tenant names are `NAME_RE`'s. An admin key belongs to no tenant (one key never both calls models and administers), and
a key without a tenant is an admin key. A key's name is one line (`KEY_NAME_PATTERN`). Every expiry is finite and at
most `MAX_TTL_S` ahead; a rotation never lets either key outlive the one it replaces.
"""

from __future__ import annotations

import re

from gateway.errors import InvalidRequest
from gateway.tenants.keys import MAX_GRACE_S, MAX_TTL_S, MIN_KEY_TTL_S, check_seconds
from gateway.tenants.records import ADMIN

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
# a key's name (a label) is one line of `tiergate keys list`'s tab-separated table and of the admin API's answers: no
# tab, newline or other C0 or C1 control, nor Unicode's line and paragraph separators (a name holding "\n<id>\tacme\t
# active" printed a row for a key that does not exist), at most 128 characters
KEY_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]{0,128}$"
_KEY_NAME = re.compile(KEY_NAME_PATTERN)


def check_tenant_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):  # `match` let a final newline through: `$` matches before one
        raise InvalidRequest("tenant names are 1-64 characters of a-z, 0-9, '.', '_' and '-'",
                             param="name", code="invalid_value")


def check_new_key(tenant: str | None, name: str, roles: tuple[str, ...]) -> None:
    """A new key's tenant, roles and name, as the rules allow them together."""
    if tenant is not None and any(r.strip().casefold() == ADMIN for r in roles):
        raise InvalidRequest("an admin key cannot belong to a tenant: issue a tenant key and a separate admin "
                             "key", param="tenant", code="admin_key_with_tenant")
    if tenant is None and ADMIN not in roles:
        raise InvalidRequest("a key without a tenant must be an admin key", param="tenant", code="tenant_required")
    if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
        raise InvalidRequest("name: at most 128 characters on one line, without tabs or other control characters",
                             param="name", code="invalid_value")


def new_key_expiry(now: float, ttl_s: float | None, expires_at: float | None) -> float | None:
    """A new key's expiry: `ttl_s` from `now`, or `expires_at`, or never; either given is checked."""
    if ttl_s is not None:
        if expires_at is not None:
            raise InvalidRequest("give a time to live or an expiry time, not both", param="ttl_s",
                                 code="conflicting_parameters")
        return now + seconds(ttl_s, "ttl_s", MAX_TTL_S, minimum=MIN_KEY_TTL_S)
    if expires_at is not None and not (isinstance(expires_at, int | float)
                                       and now + MIN_KEY_TTL_S <= expires_at <= now + MAX_TTL_S):  # NaN fails both
        raise InvalidRequest(f"expires_at: must be a time at least {MIN_KEY_TTL_S:g} second in the future, at most "
                             f"{MAX_TTL_S / 86400:.0f} days ahead", param="expires_at", code="invalid_duration")
    return expires_at


def rotation_spans(grace_s: float, ttl_s: float | None) -> tuple[float, float | None]:
    """A rotation's grace period (0 for none) and its new key's time to live (None: the old key's), checked."""
    return (seconds(grace_s, "grace_s", MAX_GRACE_S, allow_zero=True),
            seconds(ttl_s, "ttl_s", MAX_TTL_S, minimum=MIN_KEY_TTL_S) if ttl_s is not None else None)


def replacement_expiry(old_expires_at: float | None, now: float, ttl_s: float | None) -> float | None:
    """A rotation's new key expires after `ttl_s` or when the old one would have, whichever is first (a key without
    expiry may be given one). A key from before expiries were bounded is brought within the bound, never past its own
    end."""
    cap = now + MAX_TTL_S if old_expires_at is not None else None
    return earliest(old_expires_at, cap, now + ttl_s if ttl_s is not None else None)


def one_line(name: str) -> str:
    """A name issued before KEY_NAME_PATTERN, as its replacement's: each control a space, cut at 128 characters."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", " ", name)[:128]


def seconds(value: object, param: str, maximum: float, *, minimum: float = 0.0, allow_zero: bool = False) -> float:
    """`value` checked as a finite span of seconds, or a 400 naming `param`."""
    try:
        return check_seconds(value, maximum=maximum, minimum=minimum, allow_zero=allow_zero)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param, code="invalid_duration") from exc


def earliest(*times: float | None) -> float | None:
    """The first of the given instants; None (never) only when all are None."""
    return min((t for t in times if t is not None), default=None)
