"""Closing a cascade (its client left while a streamed answer went live) closes the attempt's answer that was live,
at once, so its `finally` settles it then: the first answer that the look-ahead kept, or the dearer tier's retry.
(tests/gateway/test_cascade_stream_client_leaves.py drives the stream without a look-ahead through the gateway.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.pipeline import cascade as cascade_module
from gateway.pipeline.events import Delta, Head
from gateway.pipeline.meter import Reading
from tiers.cascade import Verdict


class FakePipeline:
    """`answer` streams a head and three pieces, asking the look-ahead after the head; `closed` lists the attempts
    whose answer's `finally` ran."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def head(self, ctx: Any, req: Any, attempt: Any, extra: dict[str, str] | None = None) -> Head:
        return Head(f"chatcmpl-{attempt.request_id}", 0, "tier", dict(extra or {}), stream=True, include_usage=False)

    async def answer(self, ctx: Any, prepared: Any, *, judge: Any = None, headers: dict[str, str] | None = None,
                     reading: Any = None, look: Any = None) -> Any:
        attempt = prepared.attempt
        try:
            yield self.head(ctx, prepared.req, attempt, headers)
            if look is not None and await look(attempt, SimpleNamespace(), False):
                return  # cut: the retry answers
            for word in ("one", "two", "three"):
                yield Delta(word, None)
        finally:
            self.closed.append(attempt.request_id)


@dataclass(frozen=True)
class FakeAttempt:
    """What the cascade reads of an attempt (and `replace`s: the look-ahead's note)."""

    request_id: str
    route: Any = field(default_factory=lambda: SimpleNamespace(tier=SimpleNamespace(name="small"),
                                                               route=SimpleNamespace(floor=0.8)))
    extra_reason: tuple[str, ...] = ()


def prepared(request_id: str) -> Any:
    return SimpleNamespace(req=SimpleNamespace(stream=True), keep=None, attempt=FakeAttempt(request_id))


@pytest.mark.parametrize("kept", [True, False])
def test_closing_the_cascade_closes_the_live_answer_at_once(monkeypatch: pytest.MonkeyPatch, kept: bool) -> None:
    pipeline, first, retry = FakePipeline(), prepared("r1"), prepared("r1-cascade")

    async def check(*_: Any) -> cascade_module.Check:
        return cascade_module.Check(Reading(0, 1), "mid", None)

    async def escalate(*_: Any) -> cascade_module.Step:
        return cascade_module.Step(first.attempt, retry, "small->mid")

    verdict = (None, "kept by the look-ahead") if kept else (Verdict("low_confidence", "unsure"), None)
    monkeypatch.setattr(cascade_module, "_check", check)
    monkeypatch.setattr(cascade_module, "_escalate", escalate)
    monkeypatch.setattr(cascade_module, "check_confidence", lambda *_, **__: verdict)
    monkeypatch.setattr(cascade_module, "values_of", lambda *_, **__: None)

    async def main() -> list[str]:
        ctx = SimpleNamespace(t0=0.0, plan=SimpleNamespace(routing=SimpleNamespace(cascade_min_mean_logprob=None)))
        events = cascade_module.cascade(pipeline, ctx, first)  # type: ignore[arg-type]
        assert isinstance(await anext(events), Head)
        assert isinstance(await anext(events), Delta)  # live: the kept first answer's, or the retry's
        await events.aclose()  # the client left
        return list(pipeline.closed)

    closed = asyncio.run(main())
    assert closed == (["r1"] if kept else ["r1", "r1-cascade"])  # the live answer closed with the cascade
