"""Tenants and keys: hashed at rest, constant-time checks, revoke / rotate / expiry, shared state."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.tenants.keys import hash_secret, parse_key
from gateway.tenants.store import ADMIN, TenantStore


@pytest.fixture
def store(tmp_path: Path) -> TenantStore:
    s = TenantStore(tmp_path / "state.db")
    s.create_tenant("acme", "standard")
    return s


def test_keys_are_stored_hashed_and_shown_once(store: TenantStore, tmp_path: Path) -> None:
    key, plaintext = store.issue_key("acme", name="ci")
    assert parse_key(plaintext) == (key.key_id, plaintext.split("-", 2)[2])
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("state.db"))
    assert plaintext.encode() not in raw and plaintext.split("-", 2)[2].encode() not in raw
    stored = sqlite3.connect(tmp_path / "state.db").execute("SELECT key_sha256 FROM api_keys").fetchone()[0]
    assert stored == hash_secret(plaintext)
    assert "key" not in key.public() and "key_sha256" not in key.public()


def test_authenticate_accepts_only_the_exact_key(store: TenantStore) -> None:
    key, plaintext = store.issue_key("acme")
    principal = store.authenticate(plaintext)
    assert principal is not None and principal.tenant.name == "acme" and principal.key.key_id == key.key_id
    assert store.authenticate(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")) is None
    assert store.authenticate(plaintext + "x") is None
    assert store.authenticate("tg-000000000000-" + plaintext.split("-", 2)[2]) is None
    assert store.authenticate("sk-something-else") is None
    assert store.authenticate("") is None


def test_revocation_by_another_connection_takes_effect_at_once(store: TenantStore, tmp_path: Path) -> None:
    key, plaintext = store.issue_key("acme")
    assert store.authenticate(plaintext) is not None  # now cached
    cli = TenantStore(tmp_path / "state.db")
    cli.revoke_key(key.key_id)
    assert store.authenticate(plaintext) is None
    cli.close()


def test_rotate_with_and_without_grace(store: TenantStore) -> None:
    old, old_plain = store.issue_key("acme")
    new, new_plain = store.rotate_key(old.key_id)
    assert store.authenticate(old_plain) is None and store.authenticate(new_plain).tenant.name == "acme"
    assert store.get_key(old.key_id).replaced_by == new.key_id
    _, newer_plain = store.rotate_key(new.key_id, grace_s=0.3)
    assert store.authenticate(new_plain) is not None and store.authenticate(newer_plain) is not None
    time.sleep(0.35)
    assert store.authenticate(new_plain) is None and store.authenticate(newer_plain) is not None
    with pytest.raises(Conflict):
        store.rotate_key(old.key_id)


def test_admin_keys_and_validation(store: TenantStore) -> None:
    _, plaintext = store.issue_key(None, roles=(ADMIN,))
    p = store.authenticate(plaintext)
    assert p.key.is_admin and p.tenant is None
    with pytest.raises(InvalidRequest):
        store.issue_key(None)
    with pytest.raises(NotFound):
        store.issue_key("nobody")
    with pytest.raises(Conflict):
        store.create_tenant("acme", "standard")
    with pytest.raises(InvalidRequest):
        store.create_tenant("Bad Name!", "standard")
    assert [t.name for t in store.list_tenants()] == ["acme"]


def test_data_versions_bump_and_are_seen_by_other_connections(store: TenantStore, tmp_path: Path) -> None:
    _, plaintext = store.issue_key("acme")
    assert store.data_version("acme") == 0  # now cached
    cli = TenantStore(tmp_path / "state.db")
    assert cli.bump_data_version("acme") == 1 and cli.bump_data_version("acme") == 2
    assert store.data_version("acme") == 0  # still the cached value...
    store.authenticate(plaintext)  # ...until a request notices the other connection's write
    assert store.data_version("acme") == 2
    with pytest.raises(NotFound):
        cli.bump_data_version("nobody")
    cli.close()
