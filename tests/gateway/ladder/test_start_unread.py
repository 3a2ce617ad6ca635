"""A ladder controller whose shared state cannot be read when it starts (Redis down): the gateway's starts anyway, at
level 0 with its source "unknown" and its status saying why, saves nothing over the state it has not read, and takes
that state at the first read that works; the CLI's still fails. The gateway did not start: `store.load()` raised in
the controller's constructor."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import Unavailable
from gateway.ladder.config import load_ladder
from gateway.ladder.controller import LadderController
from gateway.ladder.signals import Signals
from gateway.ladder.state import READ_MESSAGE, DegradeEvent, LadderState, SqliteLadderStore
from tests.gateway.ladder.test_controller import LADDER, Clock, run

TIERS = {"small", "mid", "full"}


class Outage(SqliteLadderStore):
    """A store that fails every read and write (as RedisLadderStore does, with its 503) while `down`."""

    down = True
    saves = 0

    def load(self) -> LadderState:
        if self.down:
            raise Unavailable(READ_MESSAGE, code="ladder_state_unavailable")
        return super().load()

    def save(self, state: LadderState, event: DegradeEvent | None = None) -> bool:
        if self.down:
            raise Unavailable("written", code="ladder_state_unavailable")
        self.saves += 1
        return super().save(state, event)


def started(tmp_path: Path, store: Outage, *, start_unread: bool = True) -> tuple[LadderController, Clock, Signals]:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    signals = Signals(clock=clock)
    return LadderController(load_ladder(f, TIERS), store, signals, clock=clock, start_unread=start_unread), clock, \
        signals


def shared_state(tmp_path: Path, state: LadderState) -> None:
    """What the other replicas wrote while this one could not read it."""
    store = SqliteLadderStore(tmp_path / "state.db")
    store.save(state)
    store.close()


def test_a_store_down_at_start_starts_at_level_0_unknown_and_says_why(tmp_path: Path) -> None:
    shared_state(tmp_path, LadderState(auto_level=1, manual_level=2, manual_by="k1", manual_reason="incident"))
    store = Outage(tmp_path / "state.db")
    c, clock, signals = started(tmp_path, store)
    assert (c.level, c.source, c.actions()) == (0, "unknown", [])
    status = c.status()
    assert status["level"] == 0 and status["source"] == "unknown" and status["manual"] is None
    assert status["shared_state"] == {"read": False, "error": "not read since this worker started, level 0 applies "
                                                              f"until it is: {READ_MESSAGE}"}
    # the store still down: a tick fails as a running controller's does (logged by the gateway's loop), keeps level 0
    # and moves no trigger; on-call's changes are the store's 503; nothing is written over the state not read
    with pytest.raises(Unavailable):
        run(c, clock, signals, 30, 9.0)
    with pytest.raises(Unavailable):
        c.set_manual(1, reason="drill", who="k2")
    with pytest.raises(Unavailable):
        c.set_auto(who="k2")
    assert (c.level, c.source, store.saves) == (0, "unknown", 0)
    # the store answers: the next tick takes the shared state, as a start would have
    store.down = False
    c.tick()
    assert (c.level, c.source, c.state.auto_level) == (2, "manual", 1)
    assert c.status()["shared_state"] == {"read": True, "error": None}
    assert store.saves == 0 and store.load().manual_reason == "incident"


def test_the_first_read_after_an_unread_start_may_be_an_on_call_change(tmp_path: Path) -> None:
    shared_state(tmp_path, LadderState(auto_level=1))
    store = Outage(tmp_path / "state.db")
    c, _, _ = started(tmp_path, store)
    store.down = False
    c.set_manual(2, reason="incident", who="k1")
    assert (c.level, c.source, c.state.auto_level) == (2, "manual", 1)  # the auto level read is kept, not the 0
    assert [(e.from_level, e.to_level) for e in store.history()] == [(1, 2)]
    assert c.status()["shared_state"]["read"] is True


def test_a_ladder_reloaded_before_an_unread_start_is_not_followed_when_first_read(tmp_path: Path) -> None:
    """The first read is the start's: a restart reads its file as it is, with nothing to follow until the next reload
    (gateway/ladder/controller.py), even when its store answered only later."""
    shared_state(tmp_path, LadderState(ladder_sha256="0" * 64))
    store = Outage(tmp_path / "state.db")
    c, _, _ = started(tmp_path, store)
    store.down = False
    c.tick()
    assert c.in_sync and c.status()["ladder"]["error"] is None and c.ladder.top == 2


def test_the_cli_still_fails_on_a_store_it_cannot_read(tmp_path: Path) -> None:
    """Without `start_unread` (the CLI's `tiergate degrade …`), the store's fault is raised: a status it has not read
    is not one to print."""
    with pytest.raises(Unavailable):
        started(tmp_path, Outage(tmp_path / "state.db"), start_unread=False)
