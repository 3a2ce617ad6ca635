"""API key format, hashing and constant-time verification.

A key reads `tg-<key id>-<secret>`. The key id is public (it names the key in logs, the ledger and the
admin API); the secret is 256 random bits, stored only as its SHA-256 (a fast hash is right for random
secrets: there is nothing to brute-force) and compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "tg-"
_DUMMY_HASH = hashlib.sha256(b"tiergate-no-such-key").hexdigest()


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
