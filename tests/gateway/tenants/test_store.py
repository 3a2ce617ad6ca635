"""Tenants and keys: hashed at rest, constant-time checks, revoke / rotate / expiry, shared state. Every test
runs on both stores: SQLite (embedded) and PostgreSQL (a fleet)."""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from gateway.errors import Conflict, InvalidRequest, NotFound, Unavailable
from gateway.tenants.keys import MAX_TTL_S, hash_secret, parse_key
from gateway.tenants.records import ADMIN
from gateway.tenants.store import TenantStore
from gateway.tenants.store_postgres import BUSY_MESSAGE, UNAVAILABLE_MESSAGE, PostgresTenantStore
from gateway.tenants.store_sqlite import FOLLOW_EVERY_S
from quotas.plans import Limits


class Backend:
    """Where a test's state lives: opens more connections to it (as the CLI or another replica does) and runs
    raw SQL on it (as an operator with psql or sqlite3 would)."""

    def __init__(self, kind: str, tmp_path: Path, url: str | None) -> None:
        self.kind, self.path, self.url = kind, tmp_path / "state.db", url
        self.opened: list[TenantStore] = []

    def open(self) -> TenantStore:
        store = TenantStore(self.path) if self.kind == "sqlite" else PostgresTenantStore(self.url)  # type: ignore[arg-type]
        self.opened.append(store)
        return store

    def sql(self, statement: str) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            with sqlite3.connect(self.path) as conn:
                return conn.execute(statement).fetchall()
        with psycopg.connect(self.url, autocommit=True) as conn:  # type: ignore[arg-type]
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else []


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    url = request.getfixturevalue("database_url") if request.param == "postgres" else None
    b = Backend(request.param, tmp_path, url)
    yield b
    for store in b.opened:
        store.close()


@pytest.fixture
def store(backend: Backend) -> TenantStore:
    s = backend.open()
    s.create_tenant("acme", "standard")
    return s


def eventually(check: Callable[[], bool], within_s: float = 1.0) -> float:
    """Seconds until `check()` held; fails if it did not within `within_s` (another replica's change must
    arrive within a second; SQLite's at once)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_keys_are_stored_hashed_and_shown_once(store: TenantStore, backend: Backend, tmp_path: Path) -> None:
    key, plaintext = store.issue_key("acme", name="ci")
    assert parse_key(plaintext) == (key.key_id, plaintext.split("-", 2)[2])
    if backend.kind == "sqlite":
        raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("state.db"))
    else:
        raw = repr(backend.sql("SELECT * FROM api_keys")).encode()
    assert plaintext.encode() not in raw and plaintext.split("-", 2)[2].encode() not in raw
    (stored,) = backend.sql("SELECT key_sha256 FROM api_keys")[0]
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


def test_revocation_by_another_connection_takes_effect_within_a_second(store: TenantStore,
                                                                      backend: Backend) -> None:
    key, plaintext = store.issue_key("acme")
    assert store.authenticate(plaintext) is not None  # now cached
    backend.open().revoke_key(key.key_id)  # the CLI, or another replica
    if backend.kind == "sqlite":  # the next request after FOLLOW_EVERY_S sees it
        time.sleep(FOLLOW_EVERY_S)
        assert store.authenticate(plaintext) is None
    eventually(lambda: store.authenticate(plaintext) is None)


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
    with pytest.raises(InvalidRequest) as refused:  # named by the caller: a 400 naming the field, not a 404
        store.issue_key("nobody")
    assert (refused.value.param, refused.value.code) == ("tenant", "tenant_not_found")
    with pytest.raises(Conflict):
        store.create_tenant("acme", "standard")
    with pytest.raises(InvalidRequest):
        store.create_tenant("Bad Name!", "standard")
    assert [t.name for t in store.list_tenants()] == ["acme"]


@pytest.mark.parametrize("name", ["acme\n", "beta\n", "a" * 64 + "\n"])
def test_a_tenant_name_ending_in_a_newline_is_refused(store: TenantStore, name: str) -> None:
    """`$` matched before a final newline: the CLI made "acme\n", a second tenant that logs, reports and metrics
    show as acme (the admin route's pattern, read by pydantic, refused it already)."""
    with pytest.raises(InvalidRequest):
        store.create_tenant(name, "standard")
    assert [t.name for t in store.list_tenants()] == ["acme"]


def test_data_versions_bump_and_are_seen_by_other_connections(store: TenantStore, backend: Backend) -> None:
    assert store.data_version("acme") == 0  # now cached
    cli = backend.open()
    assert cli.bump_data_version("acme") == 1 and cli.bump_data_version("acme") == 2
    eventually(lambda: store.data_version("acme") == 2)
    with pytest.raises(NotFound):
        cli.bump_data_version("nobody")


def test_new_tenants_plan_changes_and_new_keys_reach_other_connections(store: TenantStore,
                                                                       backend: Backend) -> None:
    _, plaintext = store.issue_key("acme")
    assert store.authenticate(plaintext).tenant.plan == "standard"  # type: ignore[union-attr]
    other = backend.open()
    assert other.set_plan("acme", "metered").plan == "metered"
    eventually(lambda: store.authenticate(plaintext).tenant.plan == "metered")  # type: ignore[union-attr]
    other.create_tenant("globex", "standard")
    _, globex_key = other.issue_key("globex")
    assert store.authenticate(globex_key).tenant.name == "globex"  # type: ignore[union-attr]
    assert [t.name for t in store.list_tenants()] == ["acme", "globex"]
    with pytest.raises(NotFound):
        other.set_plan("nobody", "standard")


def test_an_unknown_key_id_is_answered_from_the_cache_until_something_changes(store: TenantStore,
                                                                             backend: Backend) -> None:
    """A flood of one unknown key id costs no query per request; any change empties the cache."""
    probe = "tg-0123456789ab-" + "x" * 43
    queries: list[str] = []
    real = store._fetchone

    def counting(sql: str, args: tuple[Any, ...] = ()) -> Any:
        queries.append(sql)
        return real(sql, args)

    def cost(n: int) -> int:
        before = len(queries)
        assert all(store.authenticate(probe) is None for _ in range(n))
        return len(queries) - before

    store._fetchone = counting  # type: ignore[method-assign]
    eventually(lambda: cost(1) == 0)  # cached (PostgreSQL: once its listener follows the changes)
    assert cost(1000) == 0
    backend.open().create_tenant("globex", "standard")
    eventually(lambda: cost(1) == 1)


@pytest.mark.parametrize("roles", [(ADMIN,), ("reader", ADMIN), ADMIN, (" Admin ",), ["ADMIN"]])
def test_an_admin_key_cannot_belong_to_a_tenant(store: TenantStore, roles: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        store.issue_key("acme", roles=roles)  # type: ignore[arg-type]
    assert err.value.param == "tenant" and "admin key cannot belong to a tenant" in err.value.message
    assert store.list_keys() == []


def test_a_tenant_bound_admin_row_from_before_the_rule_does_not_administer(store: TenantStore,
                                                                          backend: Backend) -> None:
    key, plaintext = store.issue_key("acme")
    backend.sql("UPDATE api_keys SET roles = '[\"admin\"]'")
    eventually(lambda: "admin" in store.authenticate(plaintext).key.roles)  # type: ignore[union-attr]
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


@pytest.mark.parametrize("expires_at", [math.nan, math.inf, 0.0, time.time() + MAX_TTL_S * 2],
                         ids=["nan", "inf", "zero", "past-max-ttl"])  # ids fixed: parallel workers collect alike
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


def test_a_flood_of_made_up_key_ids_does_not_empty_the_real_keys_cache(store: TenantStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown ids are cached apart: sending more of them than the cache holds costs the real keys nothing."""
    monkeypatch.setattr("gateway.tenants.read_cache.MAX_CACHED", 50)
    _, plaintext = store.issue_key("acme")
    eventually(lambda: store.authenticate(plaintext) is not None)
    queries: list[str] = []
    real = store._fetchone

    def counting(sql: str, args: tuple[Any, ...] = ()) -> Any:
        queries.append(sql)
        return real(sql, args)

    def cached() -> bool:
        queries.clear()
        return store.authenticate(plaintext) is not None and not queries

    store._fetchone = counting  # type: ignore[method-assign]
    eventually(cached)  # (PostgreSQL: once its listener follows the key's issue)
    for i in range(200):  # four times what each cache holds
        assert store.authenticate(f"tg-{i:012x}-" + "x" * 43) is None
    assert len(queries) == 200 and cached()  # each made-up id asked once; the real key is still cached


@pytest.mark.parametrize("written", ["1E-7", "1E+308"])
def test_a_budget_stored_in_exponent_form_reads_back_exactly(backend: Backend, store: TenantStore,
                                                              written: str) -> None:
    """Budgets were written as Decimal's `str` (0.0000001 as `1E-7`) before they were written as plain digits, and the
    API's rule refused that text on the read: the key, and every listing of keys, answered 500. A store that holds
    such a row reads it as the exact budget it was written from (dropping it would lift the key's budget)."""
    key, _ = store.issue_key("acme", limits=Limits(budget_day_usd=Decimal("1"), rpm=5))
    backend.sql(f"""UPDATE api_keys SET limits = '{{"rpm": 5, "budget_day_usd": "{written}"}}'
                    WHERE key_id = '{key.key_id}'""")
    other = backend.open()  # another replica: nothing of the first one's cache
    (listed,) = other.list_keys("acme")
    assert listed.limits == Limits.stored({"budget_day_usd": Decimal(written), "rpm": 5})  # 1E+308: above the maxima


def test_an_unreachable_fleet_database_is_a_fixed_503_and_its_error_goes_to_the_log(
        database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A key's lookup while the fleet database cannot be reached: the tenant reads a fixed sentence, never the
    driver's words (the server's address, the user); the log has them."""
    store = PostgresTenantStore(database_url)
    try:
        refused = ('connection failed: connection to server at "10.20.30.40", port 5432 failed: FATAL: password '
                   'authentication failed for user "tiergate_fleet"')

        def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise psycopg.OperationalError(refused)

        monkeypatch.setattr(store._pool, "connection", unreachable)
        with caplog.at_level(logging.ERROR, logger="tiergate.tenants"):
            for _ in range(2):  # the query that failed, then one refused at once (the breaker)
                with pytest.raises(Unavailable) as caught:
                    store.authenticate("tg-0123456789ab-" + "x" * 43)
                err = caught.value
                assert err.code == "database_unavailable" and err.retry_after == 2
                assert err.message == UNAVAILABLE_MESSAGE
        assert caplog.text.count("10.20.30.40") == 1 and "tiergate_fleet" in caplog.text
    finally:
        store.close()


def test_a_lookup_waiting_on_a_lock_another_session_holds_is_a_503_not_a_hang(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another session holds the keys table (an operator's LOCK TABLE, a long ALTER): a key's lookup waited for it
    without end, its request (and a pool connection) held; its statement timeout makes it a retryable 503 of its own
    (`database_busy`: the database answered, so no outage; tests/gateway/tenants/test_lookup_timeout.py)."""
    import threading

    from gateway.tenants import store_postgres

    monkeypatch.setattr(store_postgres, "STATEMENT_TIMEOUT_S", 0.3, raising=False)
    store = PostgresTenantStore(database_url)
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        raised: list[BaseException] = []

        def look_up() -> None:
            try:
                store.authenticate("tg-0123456789ab-" + "x" * 43)
            except BaseException as exc:  # what the lookup ended with is the test's
                raised.append(exc)

        lookup = threading.Thread(target=look_up, daemon=True)
        lookup.start()
        lookup.join(10)
        hung = lookup.is_alive()
        blocker.rollback()
        lookup.join(10)
        assert not hung
        assert len(raised) == 1 and isinstance(raised[0], Unavailable)
        assert (raised[0].code, raised[0].message, raised[0].retry_after) == ("database_busy", BUSY_MESSAGE, 1)
    finally:
        blocker.close()
        store.close()
