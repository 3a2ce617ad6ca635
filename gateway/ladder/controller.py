"""Moves the ladder: triggers raise and lower the automatic level; on-call overrides it for a while.

Rising: the highest level whose `enter` trigger has held for its duration. Falling: one level at a
time, once the current level's `exit` trigger has held for its duration and the level has been in force
for `min_dwell_s`. Separate enter and exit thresholds are the hysteresis: a metric hovering near one
threshold cannot make the level flap. A manual level outranks the triggers until its TTL ends or `auto`
is set; the triggers keep tracking underneath, so handing back is immediate and correct.

The tick and on-call's changes run in worker threads, one at a time (`_lock`): each reads the shared state, changes
it and saves it, and a tick between another change's read and its save put back the state it had read (an override
set in that moment was answered 200 and lost). Across workers and replicas each save is a compare-and-set on the
state's version (gateway/ladder/state.py): a save beaten by another worker's (which a plain save wrote over: a reload's
ladder identity lost, every other worker kept the old ladder; an override lost under another worker's tick) writes
nothing, and the change is made again on the state read anew, up to TRIES times; then on-call's change is a 503
(nothing changed) and a tick is skipped, logged (the next one tries again).

Workers sharing the state (`tiergate serve --workers N`, replicas on one Redis or fleet database) apply one ladder. A
reload, which one worker answers, writes the new ladder's identity (`Ladder.sha256`) into the shared state; every
other worker, when its tick or an on-call change reads a new one there, re-reads its own ladder file and takes it if
it is that ladder. One that cannot (its copy does not parse, cannot be read, or says something else: edited since,
or another host's copy) keeps its ladder, logs why once and shows it in its status (`ladder.in_sync`, `ladder.error`),
and tries again each tick. Until it is in sync it moves no trigger (they are the old ladder's); a level beyond its
ladder (one the others have) it applies as its deepest level, reported as `applied_level`, and it refuses to set one.
A worker's start reads the file as it is, with nothing to follow until the next reload (a restart with an edited
file is not out of sync with a reload made before it). Sharing the state in Redis, they also judge the error rate on
all their windows, not each its own (gateway/ladder/shared_signals.py).

Its status shows the metrics its last tick judged (`metrics`; `metrics_judged_at`, when): every worker sharing the
windows shows the same error rate, the one the level follows, not its own window's. Where the windows are shared it
also shows its own window's, read then (`own_window_metrics`; null where nothing is shared): one tenant's 5xx on this
worker's connections read high there and are set aside in the sum. Before its first tick has judged (and at the CLI,
which does not tick) `metrics` is its own window's, read then, and `metrics_judged_at` null. A tick that judges nothing
(out of sync, the shared state not read) leaves them as they were, with their time. No Redis call on the status path.

A gateway starts even when the shared state cannot be read (Redis down: TIERGATE_REDIS_FAILURE_MODE's `open` serves
on local limits, and a restart in an outage must not stop serving): at level 0, its source "unknown", its status
saying so (`shared_state`), nothing saved over the state it has not read. Each tick tries again, as a running
controller's tick does in an outage (it fails, is logged, keeps its level); the first read that works is taken as
its start's would have been. On-call's changes read the state first, so they keep answering 503 meanwhile.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

from gateway.config_files import ConfigFileError
from gateway.errors import TiergateError, Unavailable
from gateway.ladder.config import Action, Ladder, Trigger, load_ladder, read_ladder
from gateway.ladder.shared_signals import SharedSignals
from gateway.ladder.signals import Signals
from gateway.ladder.state import DegradeEvent, LadderState, LadderStore
from gateway.tenants.keys import MAX_TTL_S
from quotas.fault_log import STORE_ERRORS

log = logging.getLogger("tiergate.ladder")

# what a manual level's reason may not hold: C0 controls (a newline among them), DEL, C1 controls (NEL among them)
# and Unicode's line and paragraph separators; a reason is one line of the audit trail and of the log
_CONTROLS = r"\x00-\x1f\x7f-\x9f\u2028\u2029"
# the blanks that are not controls (what str.strip() removes besides them): a reason of only these says nothing
_BLANKS = r" \xa0\u1680\u2000-\u200a\u202f\u205f\u3000"
# a reason as the degrade route publishes it (JSON Schema's regex and Python's read these escapes alike)
REASON_PATTERN = f"^[^{_CONTROLS}]*[^{_CONTROLS}{_BLANKS}][^{_CONTROLS}]*$"
_CONTROL = re.compile(f"[{_CONTROLS}]")
# the shortest manual override: a shorter one has ended, or all but, when it is written (1e-300 s was taken, and
# answered 200 with level 0 in force); the longest is a key's (10 years)
MIN_TTL_S = 1.0
# a shared state that cannot be read: the store's 503 (Redis, the fleet database), or a local file locked
_STORE_FAULTS = (Unavailable, *STORE_ERRORS)
# reads, changes and saves of one change, each save beaten by another worker's, before it gives up (the docstring)
TRIES = 3
CONFLICT_MESSAGE = (f"the ladder's shared state was changed by other workers at each of {TRIES} tries; nothing was "
                    "changed; retry (GET /admin/degrade shows the level in force)")


class LadderChangeError(ValueError):
    """A change on-call asked for that the ladder refuses: `param` names the field, `code` the kind of fault."""

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_reason(reason: str) -> None:
    """Refuse (LadderChangeError) a reason the audit trail cannot keep as one line, or one that says nothing."""
    if _CONTROL.search(reason):
        raise LadderChangeError("the reason is one line of text: no newline or other control character",
                                param="reason", code="invalid_value")
    if not reason.strip():
        raise LadderChangeError("a reason is required", param="reason", code="reason_required")


class LadderController:
    def __init__(self, ladder: Ladder, store: LadderStore, signals: Signals, *,
                 clock: Callable[[], float] = time.time,
                 on_change: Callable[[DegradeEvent], None] | None = None, start_unread: bool = False) -> None:
        """Reads the shared state; with `start_unread` (the gateway) a store that cannot be read starts it without:
        level 0, `source` "unknown", `unread` saying why, until a read works (the module's docstring). Without it (the
        CLI), the store's fault is raised."""
        self.ladder = ladder
        self.store = store
        self.signals = signals
        # the workers sharing the state in Redis judge the error rate on all their windows (shared_signals.py)
        self._shared = SharedSignals.for_store(store)
        self.clock = clock
        self.on_change = on_change
        self._held_since: dict[tuple[int, str], float] = {}
        self._lock = threading.Lock()  # one read-change-save at a time (the module's docstring)
        self._sha256 = ladder.sha256
        self.ladder_error: str | None = None  # why this worker cannot take the ladder in force; None: in sync
        # why the shared state has not been read since this worker started; None: it has (the module's docstring)
        self.unread: str | None = None
        self.state = LadderState()  # a placeholder, never saved: the first read replaces it (`_read`)
        self.level, self.source = 0, "unknown"
        self._followed: str | None = None  # the shared ladder identity this worker has dealt with
        self._unread_since_start = True
        # (when, metrics) its last tick judged, None before it has (status: the module's docstring); one tuple, set
        # whole, read by status() without the lock
        self._judged: tuple[float, dict[str, float]] | None = None
        try:
            self._read()
        except _STORE_FAULTS as exc:
            if not start_unread:
                raise
            self.unread = exc.message if isinstance(exc, TiergateError) else type(exc).__name__
            log.error("degrade ladder: starting at level 0 without the shared state (%s); each tick reads it again",
                      self.unread)

    # ---- reading ----

    def _read(self) -> LadderState:
        """The shared state, read; the first read since this worker started also makes it this worker's, with the
        ladder identity it names dealt with (a start reads the file as it is: the module's docstring)."""
        state = self.store.load()
        if self._unread_since_start:
            self._unread_since_start = False
            if self.unread is not None:
                log.warning("degrade ladder: the shared state is read, after a start without it")
            self.unread = None
            self._followed = state.ladder_sha256
            self.state = replace(state)  # a change made on the state read is this worker's once saved (_commit)
            self._refresh(self.clock())
        return state

    @property
    def in_sync(self) -> bool:
        """This worker applies the ladder the last reload it saw put in force (the module's docstring)."""
        return self.ladder_error is None

    def actions(self) -> list[Action]:
        return self.ladder.levels[min(self.level, self.ladder.top)].actions

    def status(self) -> dict[str, object]:
        lv = self.ladder.levels[min(self.level, self.ladder.top)]
        s = self.state
        return {"level": self.level, "applied_level": lv.level, "name": lv.name, "source": self.source,
                "auto_level": s.auto_level,
                "manual": None if s.manual_level is None else {
                    "level": s.manual_level, "until": s.manual_until, "by": s.manual_by, "reason": s.manual_reason},
                "actions": [a.model_dump() for a in lv.actions], **self._metrics_status(),
                "levels": [{"level": x.level, "name": x.name, "description": x.description}
                           for x in self.ladder.levels],
                "ladder": {"sha256": self._sha256, "shared_sha256": s.ladder_sha256, "in_sync": self.in_sync,
                           "error": self.ladder_error},
                "shared_state": {"read": self.unread is None, "error": None if self.unread is None else
                                 f"not read since this worker started, level 0 applies until it is: {self.unread}"}}

    def _metrics_status(self) -> dict[str, object]:
        """`metrics` as the last tick judged them, with when, and this worker's own window's where the windows are
        shared (the module's docstring): local reads only, no Redis call."""
        judged = self._judged
        own = self.signals.read() if judged is None or self._shared is not None else None
        return {"metrics": own if judged is None else dict(judged[1]),
                "metrics_judged_at": None if judged is None else judged[0],
                "own_window_metrics": dict(own) if own is not None and self._shared is not None else None}

    # ---- on-call ----

    def set_manual(self, level: int, *, reason: str, who: str, ttl_s: float | None = None) -> None:
        """The level is checked against the ladder in force: the shared state is read, and a reload made on another
        worker followed, first."""
        if level < 0:
            self._no_such_level()
        check_reason(reason)
        if ttl_s is not None and not MIN_TTL_S <= ttl_s <= MAX_TTL_S:  # NaN fails both
            raise LadderChangeError(f"ttl_s is from {MIN_TTL_S:g} second to {MAX_TTL_S:.0f} seconds (10 years), "
                                    f"not {ttl_s!r}", param="ttl_s", code="invalid_value")

        def attempt() -> bool:
            now = self.clock()
            state = self._read()
            self._follow(state)
            if level > self.ladder.top:
                self._no_such_level()
            before = state.effective(now)[0]
            state.manual_level, state.manual_by, state.manual_reason = level, who, reason
            state.manual_until = now + ttl_s if ttl_s is not None else None
            ttl = f" for {ttl_s:.0f}s" if ttl_s is not None else ""
            return self._commit(state, before, who, f"manual{ttl}: {reason}", {})

        with self._lock:
            _retried(attempt)

    def _no_such_level(self) -> None:
        levels = ", ".join(f"{lv.level} {lv.name}" for lv in self.ladder.levels)
        stale = "" if self.in_sync else f" (this worker's ladder is not the one in force: {self.ladder_error})"
        raise LadderChangeError(f"level must be between 0 and {self.ladder.top}; levels: {levels}{stale}",
                                param="level", code="level_not_found")

    def set_auto(self, *, who: str, reason: str = "handed back to the triggers") -> None:
        def attempt() -> bool:
            state = self._read()
            self._follow(state)
            before = state.effective(self.clock())[0]
            state.manual_level = state.manual_until = state.manual_by = state.manual_reason = None
            return self._commit(state, before, who, reason, {})

        with self._lock:
            _retried(attempt)

    def reload(self, path: Path, tiers: Collection[str] | None = None) -> None:
        """Swap in a new ladder file; a bad one raises ConfigFileError and changes nothing (a remap naming a tier
        not in `tiers`, when given, is logged: gateway/ladder/config.py's `load_ladder`). Its identity is written
        into the shared state, for every other worker to follow (the module's docstring), with a level the new file
        does not have (the triggers' or on-call's) lowered to its top, before the swap: a store that cannot be
        written raises and the running ladder stays (it was swapped in while the answer said nothing changed, and
        the other workers would not have followed)."""
        ladder = read_ladder(path) if tiers is None else load_ladder(path, tiers)

        def attempt() -> bool:
            state = self._read()
            before = state.effective(self.clock())[0]
            state.ladder_sha256 = ladder.sha256
            if state.auto_level > ladder.top or (state.manual_level is not None and state.manual_level > ladder.top):
                state.auto_level = min(state.auto_level, ladder.top)
                if state.manual_level is not None:
                    state.manual_level = min(state.manual_level, ladder.top)
                return self._commit(state, before, "reload", f"{path} has {ladder.top + 1} levels", {})
            if not self.store.save(state):
                return False
            self.state = state
            self._refresh(self.clock())
            return True

        with self._lock:
            _retried(attempt)
            self._take(ladder)
            self._in_sync()

    def _follow(self, state: LadderState) -> None:
        """Take the ladder a reload on another worker put in force, when `state` names one this worker has not dealt
        with: its own file re-read, taken if it is that ladder; else the running one stays, and why is logged (once)
        and shown (the module's docstring)."""
        shared = state.ladder_sha256
        if shared is None or shared == self._followed:
            return
        if shared == self._sha256:  # a reload of the ladder this worker runs, or its file mended since
            self._followed = shared
            self._in_sync()
            return
        source = self.ladder.source
        if source is None:
            self._out_of_sync("this worker's ladder was not read from a file")
            return
        try:
            ladder = read_ladder(source)
        except ConfigFileError as exc:
            self._out_of_sync(str(exc))
            return
        if ladder.sha256 != shared:
            self._out_of_sync(f"{source} is not the ladder reloaded (edited since, or not the same file as the "
                              "reloading worker's); reload the ladder to put one in force")
            return
        self._take(ladder)
        log.warning("degrade ladder: took %s, reloaded on another worker (%d levels)", source, ladder.top + 1)
        self._in_sync()

    def _take(self, ladder: Ladder) -> None:
        self.ladder, self._sha256 = ladder, ladder.sha256
        self._followed = ladder.sha256
        self._held_since.clear()

    def _out_of_sync(self, why: str) -> None:
        if why != self.ladder_error:
            log.error("degrade ladder: this worker keeps its ladder (%d levels), not the one a reload put in force: "
                      "%s", self.ladder.top + 1, why)
        self.ladder_error = why

    def _in_sync(self) -> None:
        if self.ladder_error is not None:
            log.warning("degrade ladder: this worker is in sync again, with the ladder in force")
        self.ladder_error = None

    # ---- the loop ----

    def tick(self) -> None:
        """Re-read the shared state, expire an override, evaluate the triggers (called about once a second)."""
        with self._lock:
            for _ in range(TRIES):
                if self._tick():
                    return
            log.warning("degrade ladder: tick skipped: the shared state was changed by other workers at each of %d "
                        "tries", TRIES)

    def _tick(self) -> bool:
        """One try; False: its save was beaten by another worker's, nothing done (the module's docstring)."""
        now = self.clock()
        self.state = self._read()
        self._follow(self.state)
        s = self.state
        if s.manual_level is not None and s.manual_until is not None and now >= s.manual_until:
            expired = replace(s, manual_level=None, manual_until=None, manual_by=None, manual_reason=None)
            # from the override's level, in force until its TTL ended (the one this change ends)
            if not self._commit(expired, s.manual_level, "auto", "manual override expired", {}):
                return False
        if not self.in_sync or self.state.auto_level > self.ladder.top:
            self._held_since.clear()  # the triggers are the workers' in sync, with the ladder of that level
            self._refresh(now)
            return True
        metrics = self.signals.read() if self._shared is None else self._shared.read(self.signals)
        self._judged = (now, metrics)
        target = self._target(now, metrics)
        if target is not None and target != self.state.auto_level:
            why = self._why(target, metrics)
            before = self.state.effective(now)[0]
            return self._commit(replace(self.state, auto_level=target, auto_since=now), before, "auto", why, metrics)
        self._refresh(now)
        return True

    def _target(self, now: float, metrics: dict[str, float]) -> int | None:
        current = self.state.auto_level
        for lv in self.ladder.levels:
            for kind, trig in (("enter", lv.enter), ("exit", lv.exit)):
                key = (lv.level, kind)
                if trig is not None and self._holds(trig, metrics):
                    self._held_since.setdefault(key, now)
                else:
                    self._held_since.pop(key, None)
        up = [lv.level for lv in self.ladder.levels if lv.level > current and lv.enter is not None
              and self._held_for(lv.level, "enter", lv.enter, now)]
        if up:
            return max(up)
        lv = self.ladder.levels[min(current, self.ladder.top)]
        if current > 0 and lv.exit is not None and self._held_for(current, "exit", lv.exit, now) \
                and now - self.state.auto_since >= lv.min_dwell_s:
            return current - 1
        return None

    def _holds(self, trig: Trigger, metrics: dict[str, float]) -> bool:
        return any(c.holds(metrics[c.metric]) for c in trig.any)

    def _held_for(self, level: int, kind: str, trig: Trigger, now: float) -> bool:
        since = self._held_since.get((level, kind))
        return since is not None and now - since >= trig.for_s

    def _why(self, target: int, metrics: dict[str, float]) -> str:
        lv = self.ladder.levels[target if target > self.state.auto_level else self.state.auto_level]
        trig = lv.enter if target > self.state.auto_level else lv.exit
        assert trig is not None
        held = [f"{c.metric} {'>' if c.above is not None else '<'} {c.above if c.above is not None else c.below}"
                for c in trig.any if c.holds(metrics[c.metric])]
        return f"{' or '.join(held)} for {trig.for_s:.0f}s"

    def _commit(self, state: LadderState, before: int, who: str, reason: str, metrics: dict[str, float]) -> bool:
        """Save `state` with its event; only then is it this controller's (a save that fails, or is beaten by another
        worker's: False, leaves it as it was). `before`: the level in force in the shared state read, the one `state`
        is made from (the event's from-level; this worker's own level may be older: another worker's change since its
        last tick)."""
        now = self.clock()
        after, source = state.effective(now)
        event = DegradeEvent(now, before, after, who, reason, metrics)
        if not self.store.save(state, event):
            return False
        self.state, self.level, self.source = state, after, source
        log.warning("degrade level %d -> %d by %s: %r", before, after, who, reason)  # quoted: one line, whatever in it
        if self.on_change is not None:
            self.on_change(event)
        return True

    def _refresh(self, now: float) -> None:
        """Follow changes made elsewhere (the CLI, another replica) without recording them twice."""
        level, source = self.state.effective(now)
        if (level, source) != (self.level, self.source):
            self.level, self.source = level, source


def _retried(attempt: Callable[[], bool]) -> None:
    """`attempt` (a read, a change, a save) again while another worker's save beats its own: TRIES times, then a 503
    with nothing changed (the module's docstring)."""
    for _ in range(TRIES):
        if attempt():
            return
    raise Unavailable(CONFLICT_MESSAGE, code="ladder_state_conflict", retry_after=1)
