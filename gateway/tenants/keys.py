"""API key format, hashing and constant-time verification.

A key reads `tg-<key id>-<secret>`. The key id is public (it names the key in logs, the ledger and the
admin API); the secret is 256 random bits, stored only as its SHA-256 (a fast hash is right for random
secrets: there is nothing to brute-force) and compared with `hmac.compare_digest`. Neither the key nor its
secret is ever logged or put in an error message; the key id is what names a key.

Lifetimes are finite: a time to live is a number of seconds from `MIN_KEY_TTL_S` up to `MAX_TTL_S`, so that NaN,
infinity or a century cannot pass for "expires" while meaning "never", nor 1e-300 for a key (issued, or rotated to)
that is dead when it is shown "once; store it now".
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets

PREFIX = "tg-"
_DUMMY_HASH = hashlib.sha256(b"tiergate-no-such-key").hexdigest()

MIN_KEY_TTL_S = 1.0  # a key lives at least a second (as a degrade level's TTL), through every way one is issued
MAX_TTL_S = 10 * 365 * 86400.0  # ten years: a longer "expiry" is a key that never expires, in disguise
MAX_GRACE_S = 7 * 86400.0  # how long a rotated key may keep working beside its successor (Stripe's bound too)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,9})?)([smhd]?)")


def new_key() -> tuple[str, str]:
    """Return (key id, full key to show once)."""
    key_id = secrets.token_hex(6)
    return key_id, f"{PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


def parse_key(key: str) -> tuple[str, str] | None:
    """Split a presented key into (key id, secret); None when it is not shaped like ours."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX):].partition("-")
    if not sep or len(key_id) != 12 or not secret:
        return None
    return key_id, secret


def hash_secret(key: str) -> str:
    """The stored form of a key: SHA-256 of the whole key."""
    return hashlib.sha256(key.encode()).hexdigest()


def verify(key: str, stored_hash: str | None) -> bool:
    """Constant-time check; an unknown key id costs the same as a wrong secret."""
    return hmac.compare_digest(hash_secret(key), stored_hash or _DUMMY_HASH) and stored_hash is not None


def parse_duration(text: str) -> float:
    """`3600`, `90s`, `30m`, `12h` or `30d` to seconds; ValueError for anything else (`nan`, `inf`, `-5`)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text[:40]!r} is not a duration: use seconds or a number with s, m, h or d (e.g. 30d)")
    return float(match[1]) * _UNITS[match[2]]


def check_seconds(value: object, *, maximum: float, minimum: float = 0.0, allow_zero: bool = False) -> float:
    """`value` as a finite number of seconds in (0, maximum] (or [0, maximum]), and at least `minimum` where it is
    not 0; ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number of seconds")
    if not math.isfinite(value):
        raise ValueError("must be a finite number of seconds")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError("must be greater than 0" if not allow_zero else "must not be negative")
    if 0 < value < minimum:
        raise ValueError(f"must be at least {minimum:g} second{'s' if minimum != 1 else ''}")
    if value > maximum:
        raise ValueError(f"must be at most {maximum:.0f} seconds ({maximum / 86400:.0f} days)")
    return float(value)
