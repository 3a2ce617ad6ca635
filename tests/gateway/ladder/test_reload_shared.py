"""Workers sharing the ladder's state (`tiergate serve --workers N`, replicas on one Redis) apply one ladder: a reload
answered by one worker is followed by every other at its next tick or change. The reload swapped the ladder of the
worker that answered it only: the others kept the old one, reported a level set on the new one under an old name,
applied another level's actions and refused the new levels (`level_not_found`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gateway.ladder.config import load_ladder
from gateway.ladder.controller import LadderChangeError, LadderController
from gateway.ladder.signals import Signals
from gateway.ladder.state import (
    LadderState,
    LadderStore,
    PostgresLadderStore,
    RedisLadderStore,
    SqliteLadderStore,
)
from gateway.metrics import GatewayMetrics
from tests.gateway.ladder.test_controller import LADDER, Clock

TIERS = ["small", "mid", "full"]
FIVE = LADDER + """  - level: 3
    name: survive
    actions: [{shed: [batch, standard]}]
  - level: 4
    name: extra
    actions: [{shed: [batch, standard, interactive]}]
"""
TWO = LADDER[:LADDER.index("  - level: 2")]
Stores = Callable[[str], LadderStore]


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """A store for each worker over one shared state: the data directory's SQLite file (the workers of one host),
    Redis (replicas anywhere; each keeps its own local audit file) or the fleet database."""
    opened: list[LadderStore] = []

    def store(name: str) -> LadderStore:
        if request.param == "sqlite":
            s: LadderStore = SqliteLadderStore(tmp_path / "state.db")
        elif request.param == "postgres":
            s = PostgresLadderStore(request.getfixturevalue("database_url"))
        else:
            s = RedisLadderStore(request.getfixturevalue("redis_url"), SqliteLadderStore(tmp_path / f"{name}.db"))
        opened.append(s)
        return s

    yield store
    for s in opened:
        s.close()


def worker(f: Path, store: LadderStore, clock: Clock | None = None) -> LadderController:
    """A worker as gateway/app.py builds it: the ladder file read with the tiers file's names."""
    clock = clock or Clock()
    return LadderController(load_ladder(f, TIERS), store, Signals(clock=clock), clock=clock)


def test_a_reload_on_one_worker_is_applied_by_the_others_at_their_next_tick(tmp_path: Path, shared: Stores) -> None:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    a, b = worker(f, shared("a")), worker(f, shared("b"))
    f.write_text(FIVE)
    a.reload(f, TIERS)
    b.tick()
    assert b.ladder.top == 4 and [lv["name"] for lv in b.status()["levels"]][-1] == "extra"
    a.set_manual(4, reason="drill", who="k1")
    b.tick()
    assert (b.status()["level"], b.status()["name"]) == (4, "extra")
    assert [x.model_dump() for x in b.actions()] == [{"shed": ["batch", "standard", "interactive"],
                                                      "retry_after_s": 30}]
    b.set_manual(4, reason="drill again", who="k2")  # was refused: level_not_found
    # a smaller ladder: the level it lowers and the ladder, both followed
    f.write_text(TWO)
    a.reload(f, TIERS)
    b.tick()
    assert b.ladder.top == 1 and (b.level, b.status()["name"]) == (1, "conserve")


def test_a_change_on_another_worker_right_after_a_reload_knows_the_new_levels(tmp_path: Path,
                                                                             shared: Stores) -> None:
    """No tick in between: the change reads the shared state, and with it the ladder in force."""
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    a, b = worker(f, shared("a")), worker(f, shared("b"))
    f.write_text(FIVE)
    a.reload(f, TIERS)
    b.set_manual(4, reason="drill", who="k1")
    assert a.store.load().manual_level == 4 and b.status()["name"] == "extra"
    b.set_auto(who="k1")
    a.tick()
    assert a.level == 0 and a.ladder.top == 4


def test_a_worker_whose_copy_cannot_be_read_keeps_its_ladder_and_says_so(tmp_path: Path, shared: Stores,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Replicas on other hosts each read their own copy of the file: one that does not parse, or that is not the
    ladder reloaded, is not taken; the worker keeps its ladder, says why (status, one log line), applies the deepest
    level it has to a level beyond it, refuses to set such a level, and leaves the triggers to the workers in sync."""
    fa, fb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    fa.write_text(LADDER)
    fb.write_text(LADDER)
    clock = Clock()
    a, b = worker(fa, shared("a")), worker(fb, shared("b"), clock)
    fa.write_text(FIVE)
    fb.write_text(FIVE.replace("name: extra\n", "name: extra\n  bad\n"))
    a.reload(fa, TIERS)
    a.set_manual(4, reason="drill", who="k1")
    with caplog.at_level("WARNING", logger="tiergate.ladder"):
        for _ in range(25):  # queue waits that would raise the triggers' level on the old ladder
            clock.t += 1
            b.signals.queue_wait(9.0)
            b.tick()
    status = b.status()
    assert b.ladder.top == 2 and status["ladder"]["in_sync"] is False
    assert f"{fb}:" in status["ladder"]["error"] and status["ladder"]["shared_sha256"] == a.ladder.sha256
    assert (status["level"], status["applied_level"], status["name"]) == (4, 2, "protect")
    assert [x.model_dump() for x in b.actions()] == [{"shed": ["batch"], "retry_after_s": 30}]
    assert b.store.load().auto_level == 0  # the old ladder's triggers moved nothing
    metrics = GatewayMetrics()
    metrics.ladder = b
    assert b"tiergate_degrade_ladder_in_sync 0.0" in generate_latest(metrics.registry)  # what on-call's alert reads
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("degrade ladder")]
    assert len(lines) == 1 and str(fb) in lines[0] and "keeps its ladder" in lines[0], lines
    with pytest.raises(LadderChangeError) as refused:
        b.set_manual(4, reason="drill", who="k2")
    assert refused.value.code == "level_not_found" and str(fb) in str(refused.value)
    # a copy that parses but is another ladder (edited since the reload): not taken either
    fb.write_text(FIVE.replace("name: extra", "name: other"))
    b.tick()
    assert b.ladder.top == 2 and "not the ladder" in b.status()["ladder"]["error"]
    # the copy mended: taken at the next tick
    fb.write_text(FIVE)
    with caplog.at_level("WARNING", logger="tiergate.ladder"):
        b.tick()
    assert b.ladder.top == 4 and b.status()["ladder"] == a.status()["ladder"] and b.status()["name"] == "extra"
    assert b"tiergate_degrade_ladder_in_sync 1.0" in generate_latest(metrics.registry)
    assert "in sync" in caplog.records[-1].getMessage()


def test_a_worker_started_after_a_reload_runs_its_file_and_is_in_sync(tmp_path: Path, shared: Stores) -> None:
    """A worker's start reads the file, the one a reload last read or one edited since (a restart with a new file):
    it has nothing to follow until the next reload."""
    f = tmp_path / "ladder.yaml"
    f.write_text(FIVE)
    a = worker(f, shared("a"))
    a.reload(f, TIERS)
    f.write_text(LADDER)
    c = worker(f, shared("c"))
    c.tick()
    assert c.ladder.top == 2 and c.status()["ladder"]["in_sync"] is True
    a.reload(f, TIERS)
    c.tick()
    assert a.ladder.top == 2 and c.status()["ladder"] == a.status()["ladder"]


def test_a_level_beyond_the_ladder_is_its_deepest_and_moves_no_trigger(tmp_path: Path) -> None:
    """The triggers' level beyond this worker's ladder (set by workers with a longer one): the status gave the level
    under the name of another, with no word of which level's actions this worker applied."""
    store = SqliteLadderStore(tmp_path / "state.db")
    clock = Clock()
    store.save(LadderState(auto_level=4, auto_since=clock.t - 1000))
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    c = worker(f, store, clock)
    for _ in range(25):  # below level 2's exit threshold for longer than its 20 s, after its dwell
        clock.t += 1
        c.signals.queue_wait(0.1)
        c.tick()
    assert store.load().auto_level == 4 and (c.level, c.status()["applied_level"], c.status()["name"]) == (
        4, 2, "protect")


def test_a_state_without_the_ladder_field_is_read_and_written_as_before(tmp_path: Path) -> None:
    """A state written before the field existed loads; one that never had a reload is written without it (a worker
    of the version before reads it still)."""
    store = SqliteLadderStore(tmp_path / "state.db")
    store.save(LadderState(auto_level=1))
    raw = store._conn.execute("SELECT state FROM degrade_state").fetchone()[0]
    assert "ladder_sha256" not in raw and store.load() == LadderState(auto_level=1)
