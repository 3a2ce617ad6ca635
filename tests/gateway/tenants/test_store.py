"""Tenants and keys: hashed at rest, constant-time checks, revoke / rotate / expiry, shared state."""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from pathlib import Path

import pytest

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.tenants.keys import MAX_TTL_S, hash_secret, parse_key
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


@pytest.mark.parametrize("roles", [(ADMIN,), ("reader", ADMIN), ADMIN, (" Admin ",), ["ADMIN"]])
def test_an_admin_key_cannot_belong_to_a_tenant(store: TenantStore, roles: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        store.issue_key("acme", roles=roles)  # type: ignore[arg-type]
    assert err.value.param == "tenant" and "admin key cannot belong to a tenant" in err.value.message
    assert store.list_keys() == []


def test_a_tenant_bound_admin_row_from_before_the_rule_does_not_administer(store: TenantStore,
                                                                          tmp_path: Path) -> None:
    key, plaintext = store.issue_key("acme")
    sqlite3.connect(tmp_path / "state.db").execute("UPDATE api_keys SET roles = '[\"admin\"]'").connection.commit()
    principal = store.authenticate(plaintext)
    assert principal is not None and principal.tenant.name == "acme" and not principal.key.is_admin
    with pytest.raises(InvalidRequest):
        store.rotate_key(key.key_id)  # nor can it be rotated into another such key


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -math.inf, -1.0, 0, MAX_TTL_S + 1, 1e300, True, "30d"])
def test_ttls_must_be_finite_positive_and_bounded(store: TenantStore, ttl: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        store.issue_key("acme", ttl_s=ttl)  # type: ignore[arg-type]
    assert err.value.param == "ttl_s"
    key, _ = store.issue_key("acme")
    with pytest.raises(InvalidRequest) as err:
        store.rotate_key(key.key_id, ttl_s=ttl)  # type: ignore[arg-type]
    assert err.value.param == "ttl_s" and store.get_key(key.key_id).active(time.time())


@pytest.mark.parametrize("expires_at", [math.nan, math.inf, 0.0, time.time() + MAX_TTL_S * 2])
def test_absolute_expiries_must_be_ahead_and_bounded(store: TenantStore, expires_at: float) -> None:
    with pytest.raises(InvalidRequest) as err:
        store.issue_key("acme", expires_at=expires_at)
    assert err.value.param == "expires_at"


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0, 8 * 86400.0])
def test_rotation_grace_is_finite_and_bounded(store: TenantStore, grace: float) -> None:
    key, plaintext = store.issue_key("acme")
    with pytest.raises(InvalidRequest) as err:
        store.rotate_key(key.key_id, grace_s=grace)
    assert err.value.param == "grace_s" and store.authenticate(plaintext) is not None
    assert [k.key_id for k in store.list_keys()] == [key.key_id]


def test_rotation_never_extends_a_key_life(store: TenantStore) -> None:
    old, _ = store.issue_key("acme", ttl_s=2 * 86400)
    new, _ = store.rotate_key(old.key_id, ttl_s=30 * 86400, grace_s=7 * 86400)
    assert new.expires_at == old.expires_at
    assert store.get_key(old.key_id).expires_at == old.expires_at  # the grace ends with the old key at the latest
    shorter, _ = store.rotate_key(new.key_id, ttl_s=3600)
    assert shorter.expires_at <= time.time() + 3600
    forever, _ = store.issue_key("acme")
    given, _ = store.rotate_key(forever.key_id, ttl_s=600)  # a key without expiry may be given one
    assert given.expires_at is not None and given.expires_at <= time.time() + 600
    kept, _ = store.rotate_key(given.key_id)
    assert kept.expires_at == given.expires_at


def test_secrets_never_reach_the_logs(store: TenantStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key, plaintext = store.issue_key("acme")
    store.authenticate(plaintext)
    store.authenticate(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B"))
    new, new_plain = store.rotate_key(key.key_id, grace_s=60)
    store.revoke_key(new.key_id)
    text = caplog.text
    for secret in (plaintext, new_plain):
        assert secret not in text and secret.split("-", 2)[2] not in text and hash_secret(secret) not in text
