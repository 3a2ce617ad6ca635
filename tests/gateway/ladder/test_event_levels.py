"""Each ladder event's from-level is the level in force in the shared state the change was made on, not the level the
worker making it had at its last tick: with workers sharing the state (`tiergate serve --workers N`), another worker's
change since then made that one stale, and the audit trail recorded `1 -> 1` for a raise from 0 to 1 made after
another worker had lowered the level, and `0 -> 0` for an override ended that another worker had set."""

from __future__ import annotations

from pathlib import Path

from gateway.ladder.controller import LadderController
from gateway.ladder.signals import Signals
from gateway.ladder.state import SqliteLadderStore
from tests.gateway.ladder.test_controller import LADDER, Clock
from tests.gateway.ladder.test_reload_shared import worker


def workers(tmp_path: Path) -> tuple[LadderController, LadderController, Clock]:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    return (worker(f, SqliteLadderStore(tmp_path / "state.db"), clock),
            worker(f, SqliteLadderStore(tmp_path / "state.db"), clock), clock)


def levels(c: LadderController) -> list[tuple[int, int, str]]:
    return [(e.from_level, e.to_level, e.reason) for e in reversed(c.store.history())]


def test_a_raise_after_another_worker_lowered_the_level_is_recorded_from_that_level(tmp_path: Path) -> None:
    a, b, clock = workers(tmp_path)
    signals: Signals = a.signals
    for _ in range(150):  # A's waits above level 1's threshold throughout; B's window has none (below its exit's)
        clock.t += 1
        signals.queue_wait(3.0)
        a.tick()
        b.tick()
    # A raised, B lowered after the level's dwell, A raised again at its next tick: each from the level B left
    assert levels(a) == [(0, 1, "queue_wait_p95_s > 2.0 for 10s"), (1, 0, "queue_wait_p95_s < 0.5 for 20s"),
                         (0, 1, "queue_wait_p95_s > 2.0 for 10s"), (1, 0, "queue_wait_p95_s < 0.5 for 20s"),
                         (0, 1, "queue_wait_p95_s > 2.0 for 10s")]


def test_on_calls_change_on_another_worker_is_recorded_from_the_level_in_force(tmp_path: Path) -> None:
    a, b, clock = workers(tmp_path)
    b.set_manual(2, reason="incident", who="k1", ttl_s=30)
    a.set_auto(who="k2")  # A has not ticked since B's override: its own level is still 0
    b.set_manual(1, reason="drill", who="k1", ttl_s=30)
    clock.t += 31
    a.tick()  # the override expires on A, which had not seen it
    assert levels(a) == [(0, 2, "manual for 30s: incident"), (2, 0, "handed back to the triggers"),
                         (0, 1, "manual for 30s: drill"), (1, 0, "manual override expired")]
    assert all(e.from_level != e.to_level for e in a.store.history())
