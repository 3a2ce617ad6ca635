"""/metrics is rendered off the event loop, one render at a time: scrapes that come while one renders share it.

It rendered on the event loop (3,000 tenants: 1.2 s blocked a scrape, 12.4 MB of text), and two scrapes at once
rendered twice, one after the other, with every request waiting behind them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from gateway.routes import health
from tests.conftest import Gateway


def on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_the_render_runs_on_a_thread_that_runs_no_event_loop(gateway: Gateway) -> None:
    metrics = gateway.app.state.services.metrics
    render = metrics.render
    renders: list[tuple[str, bool]] = []

    def noted() -> bytes:
        renders.append((threading.current_thread().name, on_a_loop()))
        return render()

    metrics.render = noted
    with gateway.client(gateway.admin_key) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and "tiergate_requests_total" in r.text
    assert renders == [(renders[0][0], False)], "rendered on the event loop's thread"
    assert renders[0][0].startswith("tiergate-metrics")


class SlowMetrics:
    """A registry whose render waits until the test lets it go (at most `wait_s`), counting the renders."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.renders = 0

    def render(self) -> bytes:
        self.renders += 1
        self.go.wait(5)  # on the event loop (the code before), nobody sets it: the wait runs out
        return b"tiergate_up 1\n"


def test_scrapes_that_come_while_one_renders_get_its_text() -> None:
    async def main() -> tuple[list[Any], int]:
        metrics = SlowMetrics()
        scrapes = [asyncio.create_task(health.metrics.fn(metrics=metrics)) for _ in range(5)]
        await asyncio.sleep(0)  # every scrape has run to its first wait
        metrics.go.set()
        return await asyncio.gather(*scrapes), metrics.renders

    answers, renders = asyncio.run(main())
    assert {a.content for a in answers} == {b"tiergate_up 1\n"}
    assert renders == 1, f"{renders} renders for 5 scrapes at once"


def test_a_scrape_after_the_render_ended_renders_again_and_a_failed_render_fails_each_scrape_that_shared_it() -> None:
    class Failing(SlowMetrics):
        def render(self) -> bytes:
            super().render()
            raise RuntimeError("a collector broke")

    async def main() -> None:
        metrics = SlowMetrics()
        metrics.go.set()
        for _ in range(2):
            assert (await health.metrics.fn(metrics=metrics)).content == b"tiergate_up 1\n"
        assert metrics.renders == 2
        failing = Failing()
        scrapes = [asyncio.create_task(health.metrics.fn(metrics=failing)) for _ in range(3)]
        await asyncio.sleep(0)
        failing.go.set()
        results = await asyncio.gather(*scrapes, return_exceptions=True)
        assert [type(r) for r in results] == [RuntimeError] * 3
        assert failing.renders == 1

    asyncio.run(main())
