"""Where rollouts live: beside the ladder's state, in the data directory's SQLite file (embedded) or the fleet's
PostgreSQL (TIERGATE_DATABASE_URL), so the gateway's processes, its replicas and the CLI meet on one state.

Per tier, one row: its latest rollout (running, or finished: `full` keeps everyone on the candidate until the
tiers file names it `serving`), with its guards. Every change is also an audit event (who, why, when, the stage and
share it left, and for a guard's rollback each version's window at the time). Rows written before guards existed
read with the default guards. A change is a compare-and-set on the tier's revision: two admins changing one tier
at once cannot both win, and at most one rollout per tier runs.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gateway.admin_pool import AdminPool
from gateway.errors import Unavailable
from gateway.rollout.guards import Guards

log = logging.getLogger("tiergate.rollout")
# what an admin (or the CLI) reads while the data directory's state file cannot be used: why, in fixed words (the
# driver's own are the log's)
SQLITE_UNAVAILABLE = "the state database (state.db) {why}; nothing was changed; retry shortly"
SQLITE_WHY = (("locked", "is held by another writer (a running gateway, the CLI)"),
              ("busy", "is held by another writer (a running gateway, the CLI)"),
              ("readonly", "is read-only: the data directory and its files must be writable by this user"),
              ("full", "cannot be written: the disk is full"))

Stage = Literal["shadow", "canary", "paused", "full", "rolled_back"]
RUNNING: frozenset[str] = frozenset({"shadow", "canary", "paused"})  # a tier with one of these has a rollout running
Action = Literal["start", "promote", "pause", "rollback"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    tier TEXT PRIMARY KEY,
    revision INTEGER NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rollout_events (
    ts REAL NOT NULL,
    tier TEXT NOT NULL,
    event TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollout_events_ts ON rollout_events(ts);
"""


@dataclass(frozen=True)
class Rollout:
    """A tier's rollout of `candidate` over `baseline` (the version everyone had when it started)."""

    id: str  # salts the conversation hash: each rollout draws its own canary
    tier: str
    candidate: str
    baseline: str
    stage: Stage
    share: float  # of new conversations on the candidate while canary or paused, 0 to 1
    tenants: tuple[str, ...]  # always on the candidate while canary or paused
    started_at: float
    started_by: str  # an admin key id, or `cli`
    changed_at: float
    changed_by: str
    reason: str  # of the latest change
    revision: int  # the tier's change counter (compare-and-set)
    guards: Guards = field(default_factory=Guards)  # what rolls it back by itself while it runs
    shadow: float = 0.0  # while `shadow`: the share of requests also sent to the candidate, 0 to 1

    def public(self) -> dict[str, Any]:
        return asdict(self) | {"tenants": list(self.tenants), "guards": self.guards.model_dump()}

    def dumps(self) -> str:
        return json.dumps(self.public())

    def changed(self, *, stage: Stage, who: str, reason: str, now: float, share: float | None = None) -> Rollout:
        """The rollout after a change by `who` (the next revision)."""
        return replace(self, stage=stage, share=self.share if share is None else share, changed_at=now,
                       changed_by=who, reason=reason, revision=self.revision + 1)


@dataclass(frozen=True)
class RolloutEvent:
    """One change of a rollout, as the audit trail keeps it."""

    ts: float
    tier: str
    rollout_id: str
    action: Action
    stage: Stage  # the stage it left
    share: float
    tenants: tuple[str, ...]
    candidate: str
    baseline: str
    who: str  # an admin key id, `cli`, or `guard` (an automatic rollback)
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)  # version -> its guard window at the time (a guard's)

    @classmethod
    def of(cls, action: Action, r: Rollout, metrics: dict[str, Any] | None = None) -> RolloutEvent:
        return cls(r.changed_at, r.tier, r.id, action, r.stage, r.share, r.tenants, r.candidate, r.baseline,
                   r.changed_by, r.reason, metrics or {})

    def public(self) -> dict[str, Any]:
        return asdict(self) | {"tenants": list(self.tenants)}


def _rollout(raw: str) -> Rollout:
    data = json.loads(raw)
    guards = Guards.model_validate(data.get("guards", {}))
    return Rollout(**data | {"tenants": tuple(data["tenants"]), "guards": guards})


def _event(raw: str) -> RolloutEvent:
    data = json.loads(raw)
    return RolloutEvent(**data | {"tenants": tuple(data["tenants"])})


class RolloutStore(ABC):
    @abstractmethod
    def load(self) -> dict[str, Rollout]:
        """Each tier's latest rollout."""

    @abstractmethod
    def save(self, rollout: Rollout, event: RolloutEvent) -> bool:
        """Store the tier's new rollout state and its event, if the tier's stored revision is still the one before
        `rollout.revision` (0: none); False, and nothing written, if someone changed it meanwhile."""

    @abstractmethod
    def history(self, tier: str | None = None, limit: int = 100) -> list[RolloutEvent]:
        """The latest events first, of one tier or all."""

    def close(self) -> None:  # noqa: B027
        """Release connections."""


class SqliteRolloutStore(RolloutStore):
    """Rollouts in the data directory's SQLite file. A file that cannot be read or written now (locked past
    `timeout_s` by another writer, the disk full or read-only) is a retryable 503 with nothing changed, as the
    fleet database's outage is; the driver's words are the log's."""

    def __init__(self, path: Path, timeout_s: float = 5.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, isolation_level=None, timeout=timeout_s, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA)
        self._lock = threading.Lock()

    @contextmanager
    def _turn(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.OperationalError as exc:
                log.error("rollout store: the state database cannot be used, admin changes get 503: %s", exc)
                why = next((words for key, words in SQLITE_WHY if key in str(exc)), "cannot be used now")
                raise Unavailable(SQLITE_UNAVAILABLE.format(why=why), code="database_unavailable",
                                  retry_after=2) from exc

    def load(self) -> dict[str, Rollout]:
        with self._turn() as conn:
            rows = conn.execute("SELECT tier, state FROM rollouts").fetchall()
        return {tier: _rollout(state) for tier, state in rows}

    def save(self, rollout: Rollout, event: RolloutEvent) -> bool:
        with self._turn() as conn:
            conn.execute("BEGIN IMMEDIATE")  # the revision read and the write in one writer's turn
            try:
                row = conn.execute("SELECT revision FROM rollouts WHERE tier = ?", (rollout.tier,)).fetchone()
                if (row[0] if row else 0) != rollout.revision - 1:
                    conn.execute("ROLLBACK")
                    return False
                conn.execute("INSERT INTO rollouts(tier, revision, state) VALUES (?, ?, ?) ON CONFLICT(tier) "
                             "DO UPDATE SET revision = excluded.revision, state = excluded.state",
                             (rollout.tier, rollout.revision, rollout.dumps()))
                conn.execute("INSERT INTO rollout_events(ts, tier, event) VALUES (?, ?, ?)",
                             (event.ts, event.tier, json.dumps(asdict(event))))
                conn.execute("COMMIT")
                return True
            except BaseException:
                if conn.in_transaction:  # (a failed COMMIT may have ended it already)
                    conn.execute("ROLLBACK")
                raise

    def history(self, tier: str | None = None, limit: int = 100) -> list[RolloutEvent]:
        where, args = ("WHERE tier = ?", (tier,)) if tier is not None else ("", ())
        with self._turn() as conn:
            rows = conn.execute(f"SELECT event FROM rollout_events {where} ORDER BY ts DESC, rowid DESC "
                                "LIMIT ?", (*args, limit)).fetchall()
        return [_event(r[0]) for r in rows]

    def close(self) -> None:
        self._conn.close()


class PostgresRolloutStore(RolloutStore):
    """Rollouts and their events in the fleet database; unreachable, it is a retryable 503 for admins' changes
    (the gateway's follower logs it and keeps the rollouts it read last)."""

    def __init__(self, url: str) -> None:
        self._db = AdminPool(url, component=COMPONENT, migrations=MIGRATIONS, name="rollouts")

    def load(self) -> dict[str, Rollout]:
        with self._db.connection() as conn:
            rows = conn.execute("SELECT tier, state FROM rollouts").fetchall()
        return {tier: _rollout(state) for tier, state in rows}

    def save(self, rollout: Rollout, event: RolloutEvent) -> bool:
        state = rollout.dumps()
        with self._db.connection() as conn, conn.transaction():
            if rollout.revision == 1:
                done = conn.execute("INSERT INTO rollouts(tier, revision, state) VALUES (%s, 1, %s) "
                                    "ON CONFLICT (tier) DO NOTHING", (rollout.tier, state)).rowcount
            else:
                done = conn.execute("UPDATE rollouts SET revision = %s, state = %s WHERE tier = %s AND revision = %s",
                                    (rollout.revision, state, rollout.tier, rollout.revision - 1)).rowcount
            if done:
                conn.execute("INSERT INTO rollout_events(ts, tier, event) VALUES (%s, %s, %s)",
                             (event.ts, event.tier, json.dumps(asdict(event))))
        return bool(done)

    def history(self, tier: str | None = None, limit: int = 100) -> list[RolloutEvent]:
        where, args = ("WHERE tier = %s", (tier,)) if tier is not None else ("", ())
        with self._db.connection() as conn:
            rows = conn.execute(f"SELECT event FROM rollout_events {where} ORDER BY ts DESC, id DESC LIMIT %s",
                                (*args, limit)).fetchall()
        return [_event(r[0]) for r in rows]

    def close(self) -> None:
        self._db.close()


COMPONENT = "rollouts"
# 1: the tables as SQLite has them, with an id to order events of the same instant
MIGRATIONS = ["""
    CREATE TABLE rollouts (
        tier TEXT PRIMARY KEY,
        revision INTEGER NOT NULL,
        state TEXT NOT NULL
    );
    CREATE TABLE rollout_events (
        id BIGSERIAL PRIMARY KEY,
        ts DOUBLE PRECISION NOT NULL,
        tier TEXT NOT NULL,
        event TEXT NOT NULL
    );
    CREATE INDEX rollout_events_ts ON rollout_events(ts);
"""]


def open_store(data_dir: Path, database_url: str | None = None) -> RolloutStore:
    """The fleet database's when there is one, else the data directory's SQLite file (the ladder's)."""
    return PostgresRolloutStore(database_url) if database_url else SqliteRolloutStore(data_dir / "state.db")
