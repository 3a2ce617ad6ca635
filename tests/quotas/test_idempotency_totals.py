"""PostgreSQL's per-tenant idempotency totals (quotas/idempotency_totals.py): a claim reads one row, not the tenant's
records, and the bound holds exactly when several replicas claim a tenant's new keys at once; every path that changes
the records (a claim, a stored answer, an abandon, a takeover, the prunes) keeps the totals equal to a count of
them; a database of the release before gets its records counted."""

from __future__ import annotations

import asyncio
import itertools

import psycopg
import pytest

from quotas import idempotency_postgres
from quotas.idempotency import Claim, Full, Limits, Replay, Running
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.ledger_postgres import PostgresLedger, open_schema
from tests.quotas.test_idempotency_store import Clock
from tests.quotas.test_ledger import row

TOTALS = "SELECT tenant, records, bytes FROM idempotency_tenants WHERE records <> 0 OR bytes <> 0 ORDER BY tenant"
COUNTED = ("SELECT tenant, count(*), coalesce(sum(octet_length(answer)), 0) FROM idempotency GROUP BY tenant "
           "ORDER BY tenant")


def sql(url: str, statement: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


async def test_concurrent_claims_from_several_replicas_hold_the_bound_exactly(database_url: str) -> None:
    """Four replicas (a pool of ten connections each) claim 40 new keys of one tenant at once, for tenants new and
    old: exactly the bound's worth are claimed; every other is refused, not let past it."""
    clock = Clock()
    replicas = [PostgresIdempotency(database_url, shift=clock.shift, limits=Limits(records=5)) for _ in range(4)]
    try:
        for round_ in range(5):
            tenant = f"t{round_}"
            begun = await asyncio.gather(*(replicas[i % 4].begin(tenant, f"k{i}", "body", f"r{i}", lease_s=60)
                                           for i in range(40)))
            claims = [b for b in begun if isinstance(b, Claim)]
            assert len(claims) == 5 and all(isinstance(b, Claim | Full) for b in begun), (round_, begun)
            for claim in claims[:2]:  # two requests fail: their places are free again, for two of the next 40
                await replicas[0].abandon(claim)
            begun = await asyncio.gather(*(replicas[i % 4].begin(tenant, f"n{i}", "body", f"s{i}", lease_s=60)
                                           for i in range(40)))
            assert sum(isinstance(b, Claim) for b in begun) == 2, (round_, begun)
        assert sql(database_url, TOTALS) == sql(database_url, COUNTED) == [(f"t{i}", 5, 0) for i in range(5)]
    finally:
        for store in replicas:
            await store.close()


async def test_every_change_of_the_records_keeps_the_totals_exact(database_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims, answers stored by group commits of several tenants (and one too large, a record standing in for it), an
    abandon, a takeover of an expired key, a tenant at its bound pruning its own and the periodic prune: after each,
    the totals are what counting the records says."""
    monkeypatch.setattr(idempotency_postgres, "PRUNE_EVERY", 7)
    clock = Clock()
    ledger = PostgresLedger(database_url)
    store = PostgresIdempotency(database_url, shift=clock.shift,
                                limits=Limits(records=4, bytes=10**6, answer_bytes=900))
    ledger.start()
    ids = itertools.count(1)

    def exact() -> None:
        assert sql(database_url, TOTALS) == sql(database_url, COUNTED)

    try:
        claims = [c for tenant in ("acme", "globex", "initech") for i in range(3)
                  if isinstance(c := await store.begin(tenant, f"k{i}", "body", f"r{i}", lease_s=60), Claim)]
        assert len(claims) == 9
        exact()
        answers = {c: {"text": "é" * (50 * n)} for n, c in enumerate(claims[::-1])}  # one group, tenants mixed
        answers[claims[4]] = {"text": "x" * 1000}  # too large: not stored, a small record in its place
        await asyncio.gather(*(ledger.wait_durable(ledger.submit(row(next(ids)), with_row=store.finish_with_row(
            c, a, 100 if c.tenant == "acme" else 3600))) for c, a in answers.items()))
        assert sql(database_url, "SELECT count(*) FROM idempotency")[0] == (9,)
        exact()
        failed = await store.begin("initech", "k9", "body", "r9", lease_s=60)
        assert isinstance(failed, Claim)
        await store.abandon(failed)
        exact()
        assert await store.begin("globex", "k0", "body", "r", lease_s=60) == Replay(answers[claims[3]])
        clock.t += 101  # acme's answers expired: a key of its taken over, then at its bound its others pruned
        assert isinstance(await store.begin("acme", "k0", "other", "t0", lease_s=60), Claim)
        exact()
        for i in range(3):
            assert isinstance(await store.begin("acme", f"n{i}", "body", f"t{i}", lease_s=60), Claim)
        exact()
        assert isinstance(await store.begin("acme", "n3", "body", "t3", lease_s=60), Full)
        clock.t += 3600  # everyone's records expired; the periodic prune (every 7th claim here) deletes them
        for i in range(7):
            await store.begin("umbrella", f"k{i}", "body", f"u{i}", lease_s=60)
        assert sql(database_url, "SELECT DISTINCT tenant FROM idempotency") == [("umbrella",)]
        exact()
    finally:
        await store.close()
        ledger.close()


async def test_a_database_of_the_release_before_gets_its_records_counted(database_url: str) -> None:
    """Records written before the totals (migration 5) count from the first start with them: a tenant holding its
    bound's worth is refused a new key at once."""
    open_schema(database_url, upto=4)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.cursor().executemany("INSERT INTO idempotency VALUES (%s, %s, 'body', 'r', 'done', %s, 9e99)",
                         [("acme", f"k{i}", '{"a": 1}') for i in range(3)] + [("globex", "k0", None)])
    store = PostgresIdempotency(database_url, limits=Limits(records=3))
    try:
        assert sql(database_url, TOTALS) == [("acme", 3, 24), ("globex", 1, 0)]
        assert await store.begin("acme", "k0", "body", "r1", lease_s=60) == Replay({"a": 1})
        assert isinstance(await store.begin("acme", "k3", "body", "r1", lease_s=60), Full)
        assert isinstance(await store.begin("globex", "k1", "body", "r1", lease_s=60), Claim)
        assert await store.begin("globex", "k1", "body", "r2", lease_s=60) == Running()
    finally:
        await store.close()


async def test_a_group_commit_locks_its_tenants_totals_in_one_order(database_url: str) -> None:
    """A group commit stores answers of several tenants; each changes its tenant's totals row, locked to the commit.
    Two replicas whose groups hold the same tenants in opposite orders would deadlock (a second's stall, then a
    retry) unless every group takes them in one order: here, blocked on `a`, the group holds no lock on `b` yet,
    though `b`'s row came first."""
    ledger = PostgresLedger(database_url)
    store = PostgresIdempotency(database_url)
    ledger.start()
    blocker = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        claims = [await store.begin(tenant, "k", "body", f"r-{tenant}", lease_s=60) for tenant in ("b", "a")]
        assert all(isinstance(c, Claim) for c in claims)
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM idempotency_tenants WHERE tenant = 'a' FOR UPDATE")
            written = [ledger.submit(row(i, tenant=c.tenant), with_row=store.finish_with_row(c, {"t": c.tenant}, 60))
                       for i, c in enumerate(claims)]  # one group: `b`'s row, then `a`'s
            for _ in range(200):  # until the group waits on `a`'s lock
                waiting = sql(database_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                            "AND datname = current_database()")
                if waiting == [(1,)]:
                    break
                await asyncio.sleep(0.02)
            assert waiting == [(1,)]
            assert sql(database_url, "SELECT tenant FROM idempotency_tenants WHERE tenant = 'b' FOR UPDATE NOWAIT") \
                == [("b",)]
        await asyncio.gather(*(ledger.wait_durable(w) for w in written))
        assert await store.begin("b", "k", "body", "r", lease_s=60) == Replay({"t": "b"})
        assert sql(database_url, TOTALS) == sql(database_url, COUNTED)
    finally:
        await blocker.close()
        await store.close()
        ledger.close()


def test_the_periodic_prune_waits_for_a_group_commit_instead_of_deadlocking_with_it(database_url: str) -> None:
    """A group commit stores two answers of one tenant (its trigger holds the tenant's totals row), the second on a
    record whose lease ran out, while the periodic prune deletes expired records: the prune locks the totals row
    first, so it waits, and the record the commit brought back to life is kept (found in review: a deadlock)."""
    import threading
    import time

    from quotas.idempotency_postgres import PG_PRUNE

    open_schema(database_url)
    now = 1000.0
    shift = now - time.time()  # the database's clock moved back to `now`
    sql(database_url, "INSERT INTO idempotency VALUES ('prune-t','k1','f','o1','running',NULL,1600)")
    sql(database_url, "INSERT INTO idempotency VALUES ('prune-t','k2','f','o2','running',NULL,999)")  # lease over
    commit = psycopg.connect(database_url, autocommit=True)
    prune = psycopg.connect(database_url, autocommit=True)
    outcome: dict[str, str] = {}
    try:
        commit.execute("BEGIN")
        commit.execute(idempotency_postgres._PG_FINISH, ("a" * 10, shift, 3600, "prune-t", "k1", "o1"))

        def run_prune() -> None:
            try:
                prune.execute(PG_PRUNE, {"shift": shift})
                outcome["prune"] = "ok"
            except psycopg.Error as exc:
                outcome["prune"] = repr(exc)

        pruning = threading.Thread(target=run_prune)
        pruning.start()
        time.sleep(0.3)
        commit.execute(idempotency_postgres._PG_FINISH, ("b" * 10, shift, 3600, "prune-t", "k2", "o2"))
        commit.execute("COMMIT")
        pruning.join(10)
        assert outcome == {"prune": "ok"}
        assert sql(database_url, "SELECT key FROM idempotency WHERE tenant = 'prune-t' ORDER BY key") == [("k1",),
                                                                                                        ("k2",)]
        assert sql(database_url, "SELECT records, bytes FROM idempotency_tenants WHERE tenant = 'prune-t'") == [(2, 20)]
    finally:
        commit.close()
        prune.close()
