"""Where the ladder's level lives: SQLite in the data directory (embedded), Redis (all replicas), or the
fleet's PostgreSQL.

The state is small: the level the triggers chose, and an on-call override with its TTL. Every change is
also an audit event. Where they go (`open_store`):
- embedded: state and events in the data directory's SQLite file;
- Redis: the state in Redis (every replica reads it each tick); events in a shared Redis list and in the
  local SQLite file (durable);
- a fleet database (TIERGATE_DATABASE_URL), with or without Redis: events in PostgreSQL, durable and the
  same history on every replica; the state in Redis when there is one, else in PostgreSQL too.

A shared store that cannot be reached is a retryable 503 (`Unavailable`) for on-call's change, in OpenAI's error
shape, and the level stays as it was; the ladder's tick logs it and keeps its level. Redis (0.5 s timeout) is tried
twice first: one slow or dropped call does not fail a change. The 503 says a fixed sentence: Redis's own words (its
host and port) are the log's, logged once a fault, never a client's, even an admin's (as gateway/admin_pool.py does for
the fleet database).

Every save is a compare-and-set on the state's `version`, a counter kept beside the state (not in its JSON: the version
of the gateway before reads no field it does not know) and incremented by each save: a save made from a state read
before another worker's save writes nothing and answers False (the controller reads again and makes its change anew).
A state kept before the counter reads as version 0; a worker of the version before, in a rolling upgrade, still
writes over the state without it (as before).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeout

from gateway.admin_pool import AdminPool
from gateway.errors import Unavailable
from quotas.fault_log import redacted

log = logging.getLogger("tiergate.ladder")

# what an admin reads while the ladder's Redis cannot be reached; why is in the log
READ_MESSAGE = "the ladder's shared state could not be read (Redis failed); nothing was changed; retry"
WRITE_MESSAGE = ("the ladder's shared state could not be written (Redis failed); retry (GET /admin/degrade shows the "
                 "level in force)")
HISTORY_MESSAGE = "the ladder's shared history could not be read (Redis failed); retry"

SCHEMA = """
CREATE TABLE IF NOT EXISTS degrade_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    state TEXT NOT NULL,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS degrade_events (
    ts REAL NOT NULL,
    from_level INTEGER NOT NULL,
    to_level INTEGER NOT NULL,
    who TEXT NOT NULL,
    reason TEXT NOT NULL,
    metrics TEXT NOT NULL
);
"""
HISTORY_KEEP = 1000


@dataclass
class LadderState:
    auto_level: int = 0
    auto_since: float = 0.0
    manual_level: int | None = None
    manual_until: float | None = None  # None: until `auto` is set
    manual_by: str | None = None
    manual_reason: str | None = None
    # the ladder the last reload put in force (`Ladder.sha256`): every worker sharing the state follows it
    # (gateway/ladder/controller.py); None: none since the state began
    ladder_sha256: str | None = None
    # the stored state's save counter when read, kept beside the JSON (the module's docstring); not part of what the
    # state says (equal states compare equal at any version)
    version: int = field(default=0, compare=False)

    def effective(self, now: float) -> tuple[int, str]:
        """The level in force and who chose it (`manual` outranks the triggers until its TTL ends)."""
        if self.manual_level is not None and (self.manual_until is None or now < self.manual_until):
            return self.manual_level, "manual"
        return self.auto_level, "auto"


def state_json(state: LadderState) -> str:
    """The state as the stores keep it; without `ladder_sha256` while there is none, as the version before wrote it
    (whose workers, in a rolling upgrade, refuse a field they do not know)."""
    fields = asdict(state)
    del fields["version"]
    if fields["ladder_sha256"] is None:
        del fields["ladder_sha256"]
    return json.dumps(fields)


def state_from_json(text: str | bytes, version: int | bytes | None = 0) -> LadderState:
    """The state a store kept, at its `version` (None: kept before the counter, 0); a field this version does not know
    (a later version's) is left out, not a fault."""
    known = LadderState.__dataclass_fields__
    fields = {k: v for k, v in json.loads(text).items() if k in known and k != "version"}
    return LadderState(**fields, version=int(version or 0))


@dataclass
class DegradeEvent:
    ts: float
    from_level: int
    to_level: int
    who: str  # an admin key id, `cli`, or `auto`
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)  # what triggered it, for automatic changes


class LadderStore(ABC):
    shared_history = False  # every replica appends to and reads the same history

    @abstractmethod
    def load(self) -> LadderState: ...

    @abstractmethod
    def save(self, state: LadderState, event: DegradeEvent | None = None) -> bool:
        """Store `state` with its event if the stored state is still at `state.version` (the one it was read at);
        then `state.version` is the new one and True. False, and nothing written, if another save came between."""

    @abstractmethod
    def append(self, event: DegradeEvent) -> None:
        """Record an event without changing the state (the audit beside a state kept elsewhere)."""

    @abstractmethod
    def history(self, limit: int = 100) -> list[DegradeEvent]: ...

    def close(self) -> None:  # noqa: B027
        """Release connections."""


class SqliteLadderStore(LadderStore):
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA)
        self._lock = threading.Lock()
        if not self._has_version():  # a file from before the counter: its state is at version 0. Checked first
            with self._transaction():  # without the write lock, which every start and CLI read would take
                if not self._has_version():
                    self._conn.execute("ALTER TABLE degrade_state ADD COLUMN version INTEGER NOT NULL DEFAULT 0")

    def _has_version(self) -> bool:
        return "version" in {col[1] for col in self._conn.execute("PRAGMA table_info(degrade_state)")}

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One writer's turn of the file (BEGIN IMMEDIATE), committed, or rolled back on any fault."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # (a failed COMMIT may have ended it already)
                self._conn.execute("ROLLBACK")
            raise

    def load(self) -> LadderState:
        with self._lock:
            row = self._conn.execute("SELECT state, version FROM degrade_state WHERE id = 1").fetchone()
        return state_from_json(row[0], row[1]) if row else LadderState()

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> bool:
        with self._lock, self._transaction():
            saved = self._conn.execute(UPSERT.replace("%s", "?"), (state_json(state), state.version + 1,
                                                                  state.version)).rowcount
            if saved and event is not None:
                self._append(event)
        if saved:
            state.version += 1
        return bool(saved)

    def append(self, event: DegradeEvent) -> None:
        with self._lock, self._transaction():
            self._append(event)

    def _append(self, e: DegradeEvent) -> None:
        self._conn.execute("INSERT INTO degrade_events VALUES (?, ?, ?, ?, ?, ?)",
                           (e.ts, e.from_level, e.to_level, e.who, e.reason, json.dumps(e.metrics)))

    def history(self, limit: int = 100) -> list[DegradeEvent]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM degrade_events ORDER BY ts DESC, rowid DESC LIMIT ?",
                                      (limit,)).fetchall()
        return [DegradeEvent(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def close(self) -> None:
        self._conn.close()


class RedisLadderStore(LadderStore):
    """Shared state in Redis (every replica reads it each tick); events also kept in `local`: the local file,
    or the fleet database, whose history is then the one read (durable, and every replica's)."""

    def __init__(self, url: str, local: LadderStore, *, prefix: str = "tg", timeout_s: float = 0.5) -> None:
        import redis

        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.local = local
        self.prefix = prefix  # the workers' signals are shared under it too (gateway/ladder/shared_signals.py)
        self.state_key, self.events_key = f"{prefix}:degrade:state", f"{prefix}:degrade:events"
        self.version_key = f"{prefix}:degrade:version"  # the state's save counter (the module's docstring)
        self._logged: str | None = None  # the Redis fault last logged; None once a read worked again

    def load(self) -> LadderState:
        try:
            raw, version = self._twice(lambda _: self._read())
        except RedisError as exc:
            raise self._unavailable(exc, READ_MESSAGE) from exc
        self._logged = None  # read every tick: Redis answers again
        return state_from_json(raw, version) if raw else LadderState(version=int(version or 0))

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> bool:
        text, record = state_json(state), json.dumps(asdict(event)) if event is not None else None

        def write(again: bool) -> bool:
            with self.redis.pipeline() as pipe:
                pipe.watch(self.version_key)  # MULTI/EXEC: the state, its version and its event, or none of them
                version = int(pipe.get(self.version_key) or 0)
                if version != state.version:  # a first try whose reply was lost may have saved it: not twice
                    return again and version == state.version + 1 and pipe.get(self.state_key) == text.encode()
                pipe.multi()
                pipe.set(self.state_key, text)
                pipe.set(self.version_key, version + 1)
                if record is not None:
                    pipe.lpush(self.events_key, record)
                    pipe.ltrim(self.events_key, 0, HISTORY_KEEP - 1)
                try:
                    pipe.execute()
                except WatchError as exc:
                    if _lost_connection(exc):  # EXEC's reply never came: Redis' fault, tried again (`again`)
                        raise RedisConnectionError(str(exc)) from exc
                    return False  # another save came between
                return True

        try:
            saved = self._twice(write)
        except RedisError as exc:
            raise self._unavailable(exc, WRITE_MESSAGE) from exc
        if not saved:
            return False
        state.version += 1
        if event is not None:
            self.local.append(event)
        return True

    def _read(self) -> tuple[bytes | None, bytes | None]:
        """The state and its version: the version read first, so a save between the two reads makes the version
        older than the state (the save's compare-and-set fails, and is made again), never the state older than it."""
        version = self.redis.get(self.version_key)
        return self.redis.get(self.state_key), version

    def _unavailable(self, exc: RedisError, message: str) -> Unavailable:
        """The 503 for a Redis fault: `message`, fixed; Redis's words logged, once a fault until it answers again."""
        why = redacted(str(exc)) or type(exc).__name__
        if why != self._logged:
            self._logged = why
            log.error("ladder store: Redis failed, admin changes get 503 (%s): %s", type(exc).__name__, why)
        return Unavailable(message, code="ladder_state_unavailable", retry_after=2)

    @staticmethod
    def _twice(call: Any) -> Any:
        """`call(again)` and, if Redis fails it, once more (`again` True)."""
        try:
            return call(False)
        except RedisError:
            return call(True)

    def append(self, event: DegradeEvent) -> None:
        self.local.append(event)

    def history(self, limit: int = 100) -> list[DegradeEvent]:
        if self.local.shared_history:
            return self.local.history(limit)
        try:
            raw = self._twice(lambda _: self.redis.lrange(self.events_key, 0, limit - 1))
        except RedisError as exc:
            raise self._unavailable(exc, HISTORY_MESSAGE) from exc
        return [DegradeEvent(**json.loads(x)) for x in raw]

    def close(self) -> None:
        self.redis.close()
        self.local.close()


class PostgresLadderStore(LadderStore):
    """State and events in the fleet database; with Redis, only the events (`RedisLadderStore`'s `local`).
    The database being unreachable is a retryable 503 for on-call's changes; the ladder's tick logs it and
    keeps its level."""

    shared_history = True

    def __init__(self, url: str) -> None:
        self._db = AdminPool(url, component=COMPONENT, migrations=MIGRATIONS, name="ladder")

    def load(self) -> LadderState:
        with self._db.connection() as conn:
            row = conn.execute("SELECT state, version FROM degrade_state WHERE id = 1").fetchone()
        return state_from_json(row[0], row[1]) if row else LadderState()

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> bool:
        with self._db.connection() as conn, conn.transaction():
            saved = conn.execute(UPSERT, (state_json(state), state.version + 1, state.version)).rowcount
            if saved and event is not None:
                _append(conn, event)
        if saved:
            state.version += 1
        return bool(saved)

    def append(self, event: DegradeEvent) -> None:
        with self._db.connection() as conn:
            _append(conn, event)

    def history(self, limit: int = 100) -> list[DegradeEvent]:
        with self._db.connection() as conn:
            rows = conn.execute("SELECT ts, from_level, to_level, who, reason, metrics FROM degrade_events "
                                "ORDER BY ts DESC, id DESC LIMIT %s", (limit,)).fetchall()
        return [DegradeEvent(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def close(self) -> None:
        self._db.close()


def _append(conn: Any, e: DegradeEvent) -> None:
    conn.execute("INSERT INTO degrade_events(ts, from_level, to_level, who, reason, metrics) "
                 "VALUES (%s, %s, %s, %s, %s, %s)", (e.ts, e.from_level, e.to_level, e.who, e.reason,
                                                     json.dumps(e.metrics)))


# the compare-and-set, SQLite's and PostgreSQL's (%s: SQLite's ?): the state written, and its version counted, only
# where the stored one is still at the version it was read at (no row yet: written)
UPSERT = ("INSERT INTO degrade_state(id, state, version) VALUES (1, %s, %s) ON CONFLICT (id) "
          "DO UPDATE SET state = excluded.state, version = excluded.version WHERE degrade_state.version = %s")

COMPONENT = "ladder"
# 1: the ladder's tables as SQLite had them, with an id to order events of the same instant
MIGRATIONS = ["""
    CREATE TABLE degrade_state (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        state TEXT NOT NULL
    );
    CREATE TABLE degrade_events (
        id BIGSERIAL PRIMARY KEY,
        ts DOUBLE PRECISION NOT NULL,
        from_level INTEGER NOT NULL,
        to_level INTEGER NOT NULL,
        who TEXT NOT NULL,
        reason TEXT NOT NULL,
        metrics TEXT NOT NULL
    );
    CREATE INDEX degrade_events_ts ON degrade_events(ts);
""",
    # 2: the state's save counter, for the compare-and-set (a state kept before it is at version 0)
    "ALTER TABLE degrade_state ADD COLUMN version BIGINT NOT NULL DEFAULT 0"]


def open_store(data_dir: Path, redis_url: str | None, database_url: str | None = None) -> LadderStore:
    """The store for a deployment: see the module docstring."""
    local: LadderStore = PostgresLadderStore(database_url) if database_url else SqliteLadderStore(
        data_dir / "state.db")
    return RedisLadderStore(redis_url, local) if redis_url else local


def event_dict(e: DegradeEvent) -> dict[str, Any]:
    return asdict(e)


def _lost_connection(exc: WatchError) -> bool:
    """redis-py answers a watched transaction whose connection failed (a timeout on EXEC: it may or may not have
    applied) with a WatchError, as it does one another client's write aborted: that one is a Redis fault, not a
    conflict (its 503, and a second try that finds its own save, rather than "changed by other workers")."""
    cause = exc.__cause__ or exc.__context__
    return isinstance(cause, RedisConnectionError | RedisTimeout) or "occurred while watching" in str(exc)
