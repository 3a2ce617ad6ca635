"""The ladder's window of gateway signals: error rate and p95 wait over the last minute, read from another thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gateway.ladder.signals import WINDOW_S, Signals


def test_error_rate_and_p95_follow_the_window() -> None:
    now = [1000.0]
    signals = Signals(clock=lambda: now[0])
    for status in (200, 500, 503, 200):
        signals.outcome(status)
    for wait in [0.0] * 18 + [2.0, 5.0]:
        signals.queue_wait(wait)
    first = signals.read()
    assert first["error_rate"] == 0.5
    assert first["queue_wait_p95_s"] == 5.0  # index int(0.95 * 20) = 19 of the sorted 20
    now[0] += WINDOW_S / 2
    signals.outcome(200)
    signals.outcome(200)
    assert signals.read()["error_rate"] == 2 / 6
    now[0] += WINDOW_S / 2 + 0.001  # the first four outcomes and every wait leave the window
    after = signals.read()
    assert after["error_rate"] == 0.0
    assert after["queue_wait_p95_s"] == 0.0
    signals.outcome(502)
    assert signals.read()["error_rate"] == 1 / 3


def test_reads_from_a_thread_while_the_loop_appends() -> None:
    now = [0.0]
    signals = Signals(clock=lambda: now[0])  # 10 ms a step: a window of about 6,000 of each
    failures: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                signals.read()
            except BaseException as exc:
                failures.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(100_000):
        now[0] += 0.01
        signals.queue_wait(i / 1e6)
        signals.outcome(500 if i % 10 == 0 else 200)
    stop.set()
    thread.join()
    assert failures == []
    last = signals.read()
    assert abs(last["error_rate"] - 0.1) < 1e-3  # 6,000 outcomes in the window, one in ten a 5xx
    assert abs(last["queue_wait_p95_s"] - 0.0997) < 1e-3  # the window's waits are 0.094..0.1 s


def test_one_tenants_5xx_are_left_out_of_the_error_rate_while_the_others_have_enough_outcomes() -> None:
    """A tenant sending what makes a tier fail would, at 25% of the traffic, take the ladder to level 3 (shedding
    everyone's batch and standard traffic): its own 5xx are left out when ten of the others' outcomes say how the
    tiers do for them. Where the others are too few, or fail too, the rate counts them."""
    now = [1000.0]
    signals = Signals(clock=lambda: now[0])
    for _ in range(9):
        signals.outcome(200, "victim")
    for _ in range(30):
        signals.outcome(500, "attacker")
    assert signals.read()["error_rate"] == 30 / 39  # nine outcomes of the others: too few to leave it out
    signals.outcome(200, "victim")
    signals.outcome(200, "other")
    assert signals.read()["error_rate"] == 0.0
    for _ in range(4):
        signals.outcome(502, "victim")  # the tier now fails the others as well
    assert signals.read()["error_rate"] == 4 / 15
    signals.outcome(500)  # the gateway's own outcome (no tenant) is never the one left out
    assert signals.read()["error_rate"] == 5 / 16


def test_one_tenants_queued_flood_is_left_out_of_the_wait_p95() -> None:
    """Dispatch is fair between tenants, so a tenant flooding a tier waits in its own queue while the others do
    not; its waits alone would take the ladder to level 3 (p95 over 15 s)."""
    now = [1000.0]
    signals = Signals(clock=lambda: now[0])
    for _ in range(9):
        signals.queue_wait(0.01, "victim")
    for _ in range(200):
        signals.queue_wait(20.0, "flood")
    assert signals.read()["queue_wait_p95_s"] == 20.0  # nine waits of the others: too few to leave it out
    signals.queue_wait(0.02, "other")
    assert signals.read()["queue_wait_p95_s"] == 0.02
    for _ in range(10):
        signals.queue_wait(16.0, "victim")  # now the others wait as well
    assert signals.read()["queue_wait_p95_s"] == 16.0
    now[0] += WINDOW_S + 1  # everything leaves the window, and the counts with it
    signals.queue_wait(0.5, "flood")
    assert signals.read()["queue_wait_p95_s"] == 0.5


def two_and_two(record: Callable[[Any, str], None], victims: Any, n_victims: int, attackers_value: Any,
                n_attackers: int, *, attackers: tuple[str, str] = ("a1", "a2")) -> None:
    """`n_victims` of `victims` each for tenants v1 and v2, then `n_attackers` of `attackers_value` each for the two
    attackers, taking turns."""
    for tenant in ("v1", "v2"):
        for _ in range(n_victims):
            record(victims, tenant)
    for _ in range(n_attackers):
        for tenant in attackers:
            record(attackers_value, tenant)


def test_two_tenants_5xx_together_are_left_out_while_the_others_are_fine_and_a_fault_for_all_counts() -> None:
    now = [1000.0]
    signals = Signals(clock=lambda: now[0])
    two_and_two(signals.outcome, 200, 10, 500, 30)
    assert signals.read()["error_rate"] == 0.0  # without a1's alone, a2's 30 of the 50 left would be 0.6
    for tenant in ("v1", "v2"):
        for _ in range(10):
            signals.outcome(502, tenant)  # the tiers now fail the others as much
    assert signals.read()["error_rate"] == 50 / 70  # no one stands out: only a1 (the most 5xx) is left out


def test_two_tenants_queued_floods_are_left_out_of_the_wait_p95() -> None:
    now = [1000.0]
    signals = Signals(clock=lambda: now[0])
    two_and_two(signals.queue_wait, 0.01, 10, 20.0, 200, attackers=("f1", "f2"))
    assert signals.read()["queue_wait_p95_s"] == 0.01
    for tenant in ("v1", "v2"):
        for _ in range(30):
            signals.queue_wait(16.0, tenant)  # now the others wait as well
    assert signals.read()["queue_wait_p95_s"] == 20.0  # without f1's: f2's 200 of 280
