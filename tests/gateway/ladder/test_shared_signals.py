"""Workers sharing the ladder's state in Redis judge the error rate on all their windows (gateway/ladder/
shared_signals.py). Each judged its own: one tenant on one keep-alive connection landed all its 5xx on worker 0, which
saw too few other tenants' answers to set them aside and raised the level for everyone, while one process, seeing
them all, stayed at level 0."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.ladder import shared_signals
from gateway.ladder.config import read_ladder
from gateway.ladder.controller import LadderController
from gateway.ladder.shared_signals import SharedSignals
from gateway.ladder.signals import Signals
from gateway.ladder.state import RedisLadderStore, SqliteLadderStore
from tests.conftest import RedisServer
from tests.gateway.ladder.test_controller import Clock

LADDER = """
levels:
  - {level: 0, name: normal}
  - level: 1
    name: protect
    actions: [{shed: [batch]}]
    enter: {any: [{metric: error_rate, above: 0.2}], for_s: 10}
    exit: {any: [{metric: error_rate, below: 0.05}], for_s: 20}
    min_dwell_s: 60
"""


@pytest.fixture
def workers(tmp_path: Path, redis_url: str) -> Iterator[tuple[Clock, list[LadderController]]]:
    """Two workers over one Redis, each with its own Signals (its own connections) and local audit file."""
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    ws = [LadderController(read_ladder(f), RedisLadderStore(redis_url, SqliteLadderStore(tmp_path / f"{i}.db")),
                           Signals(clock=clock), clock=clock) for i in range(2)]
    yield clock, ws
    for w in ws:
        w.store.close()


def run(clock: Clock, ws: list[LadderController], seconds: int, traffic) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    levels = []
    for sec in range(seconds):
        clock.t += 1
        traffic(sec)
        for w in ws:
            w.tick()
        levels.append(tuple(w.level for w in ws))
    return levels


def test_one_tenants_5xx_landing_on_one_worker_are_set_aside_by_the_others_answers_on_every_worker(
        workers: tuple[Clock, list[LadderController]]) -> None:
    clock, ws = workers

    def traffic(sec: int) -> None:  # the auditor's: ladder_workers.py
        if sec >= 60:  # one tenant, one connection: a 5xx a second, all on worker 0
            ws[0].signals.outcome(502, "evil")
        if sec % 4 == 0:  # six other tenants, 15 answers a minute, spread over the workers
            ws[(sec // 4) % 2].signals.outcome(200, f"t{sec % 6}")

    levels = run(clock, ws, 300, traffic)
    assert set(levels) == {(0, 0)}  # as one process judges it: the code before raised on worker 0
    assert ws[0].store.history() == [] and ws[1].store.history() == []
    assert ws[0].signals.read()["error_rate"] > 0.2  # worker 0's own window alone would have raised


def test_status_shows_the_error_rate_the_ladder_judged_and_the_workers_own_beside_it(
        workers: tuple[Clock, list[LadderController]]) -> None:
    """GET /admin/degrade (and /admin/ops) showed each worker's own window: 0.8 on worker 0 while the ladder judged
    the sum, 0, and stayed at level 0; each worker answered differently."""
    clock, ws = workers
    before, own_then = ws[0].status(), ws[0].signals.read()  # no tick yet: its own window, read then

    def traffic(sec: int) -> None:  # as in the test above: one tenant's 5xx all on worker 0, from the second minute
        if sec >= 60:
            ws[0].signals.outcome(502, "evil")
        if sec % 4 == 0:
            ws[(sec // 4) % 2].signals.outcome(200, f"t{sec % 6}")

    assert set(run(clock, ws, 120, traffic)) == {(0, 0)}
    s0, s1 = ws[0].status(), ws[1].status()
    assert s0["metrics"]["error_rate"] == 0.0 == s1["metrics"]["error_rate"]  # what the ladder judged, on both
    assert s0["own_window_metrics"]["error_rate"] > 0.8  # worker 0's window alone
    assert s0["metrics_judged_at"] == s1["metrics_judged_at"] == clock.t
    assert s1["own_window_metrics"]["error_rate"] == 0.0
    assert before["metrics_judged_at"] is None and before["metrics"] == own_then


def test_status_of_a_worker_sharing_nothing_shows_what_it_judged_and_no_own_window_beside_it(tmp_path: Path) -> None:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    clock = Clock()
    c = LadderController(read_ladder(f), SqliteLadderStore(tmp_path / "state.db"), Signals(clock=clock), clock=clock)
    c.signals.outcome(502, "t1")
    c.tick()
    c.signals.outcome(200, "t1")  # after the tick: not judged yet
    s = c.status()
    assert s["metrics"]["error_rate"] == 1.0  # what the tick judged (read now: 0.5)
    assert (s["metrics_judged_at"], s["own_window_metrics"]) == (clock.t, None)


def test_a_fault_failing_every_tenant_on_both_workers_still_raises(
        workers: tuple[Clock, list[LadderController]]) -> None:
    clock, ws = workers

    def traffic(sec: int) -> None:
        for i, w in enumerate(ws):
            for t in range(6):
                w.signals.outcome(502 if sec >= 30 else 200, f"t{t + 6 * i}")

    levels = run(clock, ws, 60, traffic)
    assert levels[-1] == (1, 1)
    assert [(e.from_level, e.to_level, e.who) for e in ws[0].store.history()] == [(0, 1, "auto")]  # one raise


def exchange(url: str, clock: Clock, **kw) -> tuple[SharedSignals, Signals]:  # type: ignore[no-untyped-def]
    return SharedSignals(redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5), **kw), \
        Signals(clock=clock)


def attacked(signals: Signals) -> None:
    """One tenant's 5xx, and two answers of another tenant: too few to set them aside alone."""
    for _ in range(10):
        signals.outcome(502, "evil")
    for _ in range(2):
        signals.outcome(200, "t1")


def answers(signals: Signals) -> None:
    for t in range(20):
        signals.outcome(200, f"t{t % 5}")


def test_an_expired_peer_drops_out_of_the_merge(redis_url: str) -> None:
    clock = Clock()
    (a, sa), (b, sb) = exchange(redis_url, clock, worker="a"), exchange(redis_url, clock, worker="b", ttl_ms=50)
    attacked(sa)
    answers(sb)
    b.read(sb)
    assert a.read(sa)["error_rate"] == 0.0  # b's answers set evil's 5xx aside
    while a.redis.exists(b.key("b")):  # b stopped: its summary expires (50 ms)
        time.sleep(0.01)
    assert a.read(sa)["error_rate"] == pytest.approx(10 / 12)  # a's own window alone
    assert a.redis.smembers(a.members_key) == {b"a"}


def test_a_worker_alone_judges_its_own_window_as_before(redis_url: str) -> None:
    clock = Clock()
    a, sa = exchange(redis_url, clock, worker="a")
    attacked(sa)
    assert a.read(sa) == sa.read()


def test_redis_failing_falls_back_to_the_workers_own_window_logged_once(
        own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    (a, sa), (b, sb) = exchange(own_redis.url, clock, worker="a"), exchange(own_redis.url, clock, worker="b")
    attacked(sa)
    answers(sb)
    b.read(sb)
    assert a.read(sa)["error_rate"] == 0.0
    own_redis.stop()
    with caplog.at_level(logging.ERROR, logger="tiergate.ladder"):
        assert a.read(sa) == sa.read() and sa.read()["error_rate"] == pytest.approx(10 / 12)
        assert a.read(sa) == sa.read()
    assert len([r for r in caplog.records if "could not be shared" in r.message]) == 1


def test_a_worker_sums_its_own_window_once(redis_url: str) -> None:
    """Its own window comes from its Signals, never again from the summary it published (counted twice, the other
    tenants' 5 answers would read as 10, enough to set evil's 5xx aside)."""
    clock = Clock()
    (a, sa), (b, sb) = exchange(redis_url, clock, worker="a"), exchange(redis_url, clock, worker="b")
    for _ in range(10):
        sa.outcome(502, "evil")
    for t in range(5):
        sa.outcome(200, f"t{t}")
    b.read(sb)  # a live peer with an empty window
    a.read(sa)
    assert a.read(sa)["error_rate"] == pytest.approx(10 / 15)


def test_two_workers_with_one_host_name_pid_and_number_are_told_apart(redis_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas in containers sharing a host name (host networking) have the same pids: their ids differ still, so
    neither overwrites the other's summary nor skips it as its own."""
    monkeypatch.setattr(shared_signals, "_numbers", itertools.repeat(0))
    client = redis.Redis.from_url(redis_url)
    assert SharedSignals(client).worker != SharedSignals(client).worker


def test_a_summary_outlives_the_time_to_the_workers_next_tick(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker ticking every 5 s (TIERGATE_LADDER_TICK_S=5) keeps its summary alive past its next tick: with a fixed
    3 s life it dropped out of the others' sum between two of its ticks, and in again."""
    now = [1000.0]
    monkeypatch.setattr(shared_signals.time, "monotonic", lambda: now[0])
    a, sa = exchange(redis_url, Clock(), worker="a")
    a.read(sa)
    assert 0 < a.redis.pttl(a.key("a")) <= shared_signals.TTL_MS
    now[0] += 5.0
    a.read(sa)
    assert a.redis.pttl(a.key("a")) > 4 * 5_000 and a.redis.pttl(a.members_key) > 4 * 5_000
