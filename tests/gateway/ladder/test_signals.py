"""The ladder's window of gateway signals: error rate and p95 wait over the last minute, read from another thread."""

from __future__ import annotations

import threading

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
