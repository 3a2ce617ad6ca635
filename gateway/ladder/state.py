"""Where the ladder's level lives: SQLite in the data directory (embedded), or Redis (all replicas).

The state is small: the level the triggers chose, and an on-call override with its TTL. Every change is
also an audit event, always appended to the local SQLite file (durable), and, with Redis, to a shared
list so every replica's history shows it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS degrade_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    state TEXT NOT NULL
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

    def effective(self, now: float) -> tuple[int, str]:
        """The level in force and who chose it (`manual` outranks the triggers until its TTL ends)."""
        if self.manual_level is not None and (self.manual_until is None or now < self.manual_until):
            return self.manual_level, "manual"
        return self.auto_level, "auto"


@dataclass
class DegradeEvent:
    ts: float
    from_level: int
    to_level: int
    who: str  # an admin key id, `cli`, or `auto`
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)  # what triggered it, for automatic changes


class LadderStore(ABC):
    @abstractmethod
    def load(self) -> LadderState: ...

    @abstractmethod
    def save(self, state: LadderState, event: DegradeEvent | None = None) -> None: ...

    @abstractmethod
    def history(self, limit: int = 100) -> list[DegradeEvent]: ...


class SqliteLadderStore(LadderStore):
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA)
        self._lock = threading.Lock()

    def load(self) -> LadderState:
        with self._lock:
            row = self._conn.execute("SELECT state FROM degrade_state WHERE id = 1").fetchone()
        return LadderState(**json.loads(row[0])) if row else LadderState()

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> None:
        with self._lock, self._conn:
            self._conn.execute("INSERT INTO degrade_state(id, state) VALUES (1, ?) "
                               "ON CONFLICT(id) DO UPDATE SET state = excluded.state", (json.dumps(asdict(state)),))
            if event is not None:
                self._append(event)

    def append(self, event: DegradeEvent) -> None:
        with self._lock, self._conn:
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
    """Shared state in Redis (every replica reads it each tick); events also kept in the local file."""

    def __init__(self, url: str, local: SqliteLadderStore, *, prefix: str = "tg", timeout_s: float = 0.5) -> None:
        import redis

        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.local = local
        self.state_key, self.events_key = f"{prefix}:degrade:state", f"{prefix}:degrade:events"

    def load(self) -> LadderState:
        raw = self.redis.get(self.state_key)
        return LadderState(**json.loads(raw)) if raw else LadderState()

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self.state_key, json.dumps(asdict(state)))
        if event is not None:
            pipe.lpush(self.events_key, json.dumps(asdict(event)))
            pipe.ltrim(self.events_key, 0, HISTORY_KEEP - 1)
        pipe.execute()
        if event is not None:
            self.local.append(event)

    def history(self, limit: int = 100) -> list[DegradeEvent]:
        return [DegradeEvent(**json.loads(x)) for x in self.redis.lrange(self.events_key, 0, limit - 1)]


def open_store(data_dir: Path, redis_url: str | None) -> LadderStore:
    local = SqliteLadderStore(data_dir / "state.db")
    return RedisLadderStore(redis_url, local) if redis_url else local


def event_dict(e: DegradeEvent) -> dict[str, Any]:
    return asdict(e)
