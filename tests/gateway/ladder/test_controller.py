"""The ladder's triggers, hysteresis, dwell, on-call overrides, persistence and sharing through Redis."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from gateway.config_files import ConfigFileError, load_yaml
from gateway.errors import Unavailable
from gateway.ladder.config import Ladder
from gateway.ladder.controller import REASON_PATTERN, LadderChangeError, LadderController, check_reason
from gateway.ladder.signals import Signals
from gateway.ladder.state import RedisLadderStore, SqliteLadderStore
from gateway.settings import REPO_ROOT

LADDER = """
levels:
  - {level: 0, name: normal}
  - level: 1
    name: conserve
    actions: [{cap_output_tokens: 100}]
    enter: {any: [{metric: queue_wait_p95_s, above: 2.0}], for_s: 10}
    exit: {any: [{metric: queue_wait_p95_s, below: 0.5}], for_s: 20}
    min_dwell_s: 60
  - level: 2
    name: protect
    actions: [{shed: [batch]}]
    enter: {any: [{metric: queue_wait_p95_s, above: 5.0}], for_s: 10}
    exit: {any: [{metric: queue_wait_p95_s, below: 1.0}], for_s: 20}
    min_dwell_s: 60
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def make(tmp_path: Path, store=None):  # type: ignore[no-untyped-def]
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    signals = Signals(clock=clock)
    events = []
    c = LadderController(load_yaml(f, Ladder), store or SqliteLadderStore(tmp_path / "state.db"), signals,
                         clock=clock, on_change=events.append)
    return c, clock, signals, events


def run(c: LadderController, clock: Clock, signals: Signals, seconds: int, wait_s: float) -> None:
    """`seconds` of one-second ticks with every queue wait at `wait_s`."""
    for _ in range(seconds):
        clock.t += 1
        signals.queue_wait(wait_s)
        c.tick()


def test_rises_after_the_duration_and_falls_only_after_hysteresis_and_dwell(tmp_path: Path) -> None:
    c, clock, signals, events = make(tmp_path)
    run(c, clock, signals, 9, 3.0)
    assert c.level == 0  # above the threshold, but not yet for 10 s
    run(c, clock, signals, 2, 3.0)
    assert c.level == 1 and events[-1].who == "auto" and "queue_wait_p95_s > 2.0 for 10s" in events[-1].reason
    assert events[-1].metrics["queue_wait_p95_s"] == 3.0
    # relaxed to 1.0 s: below the enter threshold, not below the exit one (0.5): no change (hysteresis)
    clock.t += 61  # let the window forget the 3 s waits
    run(c, clock, signals, 120, 1.0)
    assert c.level == 1
    # below the exit threshold for 20 s, after the 60 s dwell: one level down
    clock.t += 61
    run(c, clock, signals, 19, 0.1)
    assert c.level == 1
    run(c, clock, signals, 2, 0.1)
    assert c.level == 0 and len(events) == 2


def test_dwell_holds_a_level_even_when_the_exit_holds(tmp_path: Path) -> None:
    c, clock, signals, _ = make(tmp_path)
    signals.queue_wait(3.0)
    for _ in range(11):  # one long wait, seen for 11 s: enter holds
        clock.t += 1
        c.tick()
    assert c.level == 1
    entered = c.state.auto_since
    clock.t += 1
    fresh = Signals(clock=clock)  # the slow request leaves the window at once
    c.signals = fresh
    for _ in range(50):  # the exit holds for 50 s: more than its 20 s, less than the 60 s dwell
        clock.t += 1
        fresh.queue_wait(0.1)
        c.tick()
    assert c.level == 1 and clock.t - entered < 60
    for _ in range(12):
        clock.t += 1
        fresh.queue_wait(0.1)
        c.tick()
    assert c.level == 0


def test_jumps_straight_to_the_highest_level_whose_trigger_holds(tmp_path: Path) -> None:
    c, clock, signals, events = make(tmp_path)
    run(c, clock, signals, 11, 9.0)
    assert c.level == 2 and [e.to_level for e in events] == [2]


def test_manual_outranks_triggers_until_ttl_or_auto_and_survives_restart(tmp_path: Path) -> None:
    c, clock, signals, events = make(tmp_path)
    c.set_manual(2, reason="incident 42", who="k123", ttl_s=30)
    assert c.level == 2 and c.source == "manual" and events[-1].who == "k123"
    run(c, clock, signals, 11, 3.0)  # the triggers move the automatic level underneath
    assert c.level == 2 and c.state.auto_level == 1
    reopened, _, _, _ = make(tmp_path)  # same state file: the override is still there
    assert reopened.level == 2 and reopened.state.manual_reason == "incident 42"
    run(c, clock, signals, 20, 3.0)  # TTL ends: back to what the triggers chose
    assert c.level == 1 and events[-1].reason == "manual override expired"
    c.set_manual(0, reason="false alarm", who="k123")
    assert c.level == 0
    c.set_auto(who="k123")
    assert c.level == 1 and c.source == "auto"
    history = c.store.history()
    assert [e.to_level for e in reversed(history)] == [2, 2, 1, 0, 1]
    with pytest.raises(ValueError):
        c.set_manual(7, reason="x", who="k")
    with pytest.raises(ValueError):
        c.set_manual(1, reason=" ", who="k")


def test_bad_reload_keeps_the_running_ladder(tmp_path: Path) -> None:
    c, _, _, _ = make(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(LADDER.replace("cap_output_tokens: 100", "cap_output_tokens: -5"))
    with pytest.raises(ConfigFileError) as exc:
        c.reload(bad)
    assert exc.value.line == 6 and c.ladder.top == 2 and c.actions() == []
    broken = tmp_path / "broken.yaml"
    broken.write_text("levels:\n  - {level: 0, name: normal\n")
    with pytest.raises(ConfigFileError) as exc:
        c.reload(broken)
    assert exc.value.line is not None


class FailingSaves(SqliteLadderStore):
    """A store whose writes fail while `down` (Redis or the fleet database unreachable)."""

    down = False

    def save(self, state, event=None):  # type: ignore[no-untyped-def]
        if self.down:
            raise Unavailable("the ladder's shared state could not be written", code="ladder_state_unavailable")
        return super().save(state, event)


def test_a_reload_whose_lowered_level_cannot_be_saved_keeps_the_running_ladder(tmp_path: Path) -> None:
    """The reload is answered 503 when the level it lowers cannot be saved: the new ladder was in force all the same,
    with the old level, while the answer said nothing had changed."""
    store = FailingSaves(tmp_path / "state.db")
    c, _, _, _ = make(tmp_path, store)
    c.set_manual(2, reason="incident", who="k1")
    two = tmp_path / "two.yaml"
    two.write_text(LADDER[:LADDER.index("  - level: 2")])
    store.down = True
    with pytest.raises(Unavailable):
        c.reload(two)
    assert c.ladder.top == 2 and c.level == 2 and c.actions()[0].model_dump() == {"shed": ["batch"],
                                                                                   "retry_after_s": 30}
    store.down = False
    c.reload(two)
    assert c.ladder.top == 1 and c.level == 1 and c.store.load().manual_level == 1


def test_a_reload_lowers_the_triggers_level_under_a_lower_override(tmp_path: Path) -> None:
    """The triggers' level was lowered only when it was the one in force: under an override of 0 it stayed at 2 in a
    2-level ladder, and handing back to the triggers put a level in force that the ladder did not have."""
    c, clock, signals, _ = make(tmp_path)
    run(c, clock, signals, 11, 9.0)
    c.set_manual(0, reason="false alarm", who="k1")
    two = tmp_path / "two.yaml"
    two.write_text(LADDER[:LADDER.index("  - level: 2")])
    c.reload(two)
    assert c.state.auto_level == 1 and c.store.load().auto_level == 1 and c.level == 0
    c.set_auto(who="k1")
    assert c.level == 1 and c.status()["level"] == 1


def test_a_tick_between_an_overrides_read_and_its_save_does_not_undo_it(tmp_path: Path) -> None:
    """The tick (a worker thread, every second) replaced the state an override had read and changed, before it was
    saved: the override was answered 200 and lost."""
    c, clock, _, _ = make(tmp_path)
    paused, go, calls = threading.Event(), threading.Event(), []

    def pausing_clock() -> float:  # the override's second reading of the clock is after its change, before its save
        if threading.current_thread().name == "override":
            calls.append(clock.t)
            if len(calls) == 2:
                paused.set()
                go.wait(10)
        return clock.t

    c.clock = pausing_clock
    override = threading.Thread(target=c.set_manual, args=(2,), kwargs={"reason": "incident", "who": "k1"},
                                name="override")
    override.start()
    assert paused.wait(10)
    ticker = threading.Thread(target=c.tick)
    ticker.start()
    ticker.join(1.0)  # the old code's tick ran to its end here; now it waits for the override
    go.set()
    override.join(10)
    ticker.join(10)
    assert c.store.load().manual_level == 2 and c.level == 2 and c.source == "manual"


def test_file_rules() -> None:
    load_yaml(REPO_ROOT / "degrade_ladder.yaml", Ladder)  # the shipped ladder is valid
    with pytest.raises(ValueError, match="numbered"):
        Ladder.model_validate({"levels": [{"level": 0, "name": "a"}, {"level": 2, "name": "b"}]})
    with pytest.raises(ValueError):  # the semantic threshold may only drop a little
        Ladder.model_validate({"levels": [{"level": 0, "name": "a"},
                                          {"level": 1, "name": "b", "actions": [{"semantic_threshold_delta": -0.3}]}]})


@pytest.mark.parametrize(("old", "new", "reason"), [
    # a request reads the first action of a kind: the second was ignored without a word
    ("[{cap_output_tokens: 100}]", "[{cap_output_tokens: 100}, {cap_output_tokens: 5}]",
     "levels.1.actions: Value error, more than one cap_output_tokens action"),
    # a NaN threshold never holds, and `.inf` seconds never pass: the level never entered, or never left
    ("above: 2.0", "above: .nan", "levels.1.enter.any.0.above: Input should be a finite number"),
    ("for_s: 10}\n    exit", "for_s: .inf}\n    exit", "levels.1.enter.for_s: Input should be a finite number"),
    ("min_dwell_s: 60", "min_dwell_s: .inf", "levels.1.min_dwell_s: Input should be a finite number"),
])
def test_a_level_that_cannot_act_as_written_is_refused_with_its_line(tmp_path: Path, old: str, new: str,
                                                                     reason: str) -> None:
    assert old in LADDER
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER.replace(old, new, 1))
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, Ladder)
    assert reason in exc.value.reason and exc.value.line in range(5, 10), exc.value


def test_two_replicas_share_the_level_through_redis(tmp_path: Path, redis_url: str) -> None:
    a, _, _, _ = make(tmp_path / "a", RedisLadderStore(redis_url, SqliteLadderStore(tmp_path / "a.db")))
    b, _, _, _ = make(tmp_path / "b", RedisLadderStore(redis_url, SqliteLadderStore(tmp_path / "b.db")))
    a.set_manual(2, reason="drill", who="k1")
    b.tick()
    assert b.level == 2 and b.source == "manual"
    assert [e.reason for e in b.store.history()] == ["manual: drill"]


def test_engine_kv_pressure_can_raise_the_level(tmp_path: Path) -> None:
    f = tmp_path / "ladder.yaml"
    f.write_text("levels:\n  - {level: 0, name: normal}\n  - level: 1\n    name: kv\n"
                 "    enter: {any: [{metric: kv_utilisation, above: 0.9}], for_s: 5}\n"
                 "    exit: {any: [{metric: kv_utilisation, below: 0.5}], for_s: 5}\n    min_dwell_s: 0\n")
    clock, kv = Clock(), [0.95]
    c = LadderController(load_yaml(f, Ladder), SqliteLadderStore(tmp_path / "s.db"),
                         Signals(clock=clock, kv_utilisation=lambda: kv[0]), clock=clock)
    for _ in range(6):
        clock.t += 1
        c.tick()
    assert c.level == 1 and c.store.history()[0].metrics["kv_utilisation"] == 0.95
    kv[0] = 0.2
    for _ in range(6):
        clock.t += 1
        c.tick()
    assert c.level == 0


@pytest.mark.parametrize(("level", "reason", "param", "code"), [
    (7, "x", "level", "level_not_found"),
    (1, "   ", "reason", "reason_required"),
    (1, "\u3000\xa0", "reason", "reason_required"),
    (1, "incident 42\nlevel 0 -> 3 by auto: all clear", "reason", "invalid_value"),  # a forged log line
    (1, "drill\r", "reason", "invalid_value"),
    (1, "drill\x85over", "reason", "invalid_value"),
    (1, "drill\u2028over", "reason", "invalid_value"),
    (1, "\x1b[2Jdrill", "reason", "invalid_value"),
])
def test_a_refused_override_names_its_field_and_changes_nothing(tmp_path: Path, level: int, reason: str, param: str,
                                                                code: str) -> None:
    c, _, _, events = make(tmp_path)
    with pytest.raises(LadderChangeError) as caught:
        c.set_manual(level, reason=reason, who="k")
    assert (caught.value.param, caught.value.code) == (param, code)
    assert isinstance(caught.value, ValueError)  # what the CLI prints as a usage error
    assert events == [] and c.level == 0 and c.store.history() == []


def test_the_published_reason_pattern_is_what_the_controller_takes() -> None:
    """Every character of the BMP: alone, a reason is taken exactly where the pattern the route publishes allows
    it; after a letter too (controls refused anywhere, blanks only alone)."""
    pattern = re.compile(REASON_PATTERN)
    for point in range(0x10000):
        if 0xD800 <= point < 0xE000:
            continue
        for reason in (chr(point), f"a{chr(point)}"):
            try:
                check_reason(reason)
                taken = True
            except LadderChangeError:
                taken = False
            assert taken == (pattern.fullmatch(reason) is not None), (hex(point), reason)


def test_a_reason_is_logged_on_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    c, _, _, _ = make(tmp_path)
    with caplog.at_level("WARNING", logger="tiergate.ladder"):
        c.set_manual(1, reason="incident 42", who="k")
        c.set_auto(who="k", reason="handed back\nlevel 0 -> 3 by auto: forged")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].endswith("'manual: incident 42'") and "\\nlevel 0 -> 3" in lines[1]


def test_a_level_the_ladder_has_not_is_refused_with_the_levels_it_has(tmp_path: Path) -> None:
    """`POST /admin/degrade/ {"level": 7}` said only "between 0 and N": on-call had to find the ladder file to learn
    what each level does."""
    c, _, _, _ = make(tmp_path)
    with pytest.raises(LadderChangeError) as caught:
        c.set_manual(7, reason="x", who="k")
    names = ", ".join(f"{lv.level} {lv.name}" for lv in c.ladder.levels)
    assert str(caught.value).endswith(f"levels: {names}") and len(c.ladder.levels) > 1
