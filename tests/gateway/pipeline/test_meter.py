"""The meter bills what the tier reports, and our own count only when a tier that answered reported nothing."""

from __future__ import annotations

import time

from gateway.pipeline.meter import Meter


def chunk(content: str | None = None, usage: dict | None = None, finish: str | None = None) -> dict:
    out: dict = {"choices": [{"index": 0, "delta": {"content": content} if content else {},
                              "finish_reason": finish}] if content or finish else []}
    if usage is not None:
        out["usage"] = usage
    return out


def test_the_tiers_usage_is_what_is_billed() -> None:
    meter = Meter(time.perf_counter(), counted_input=99)
    for piece in ("Par", "is"):
        meter.add(chunk(piece))
    meter.add(chunk(usage={"prompt_tokens": 12, "completion_tokens": 5}, finish="stop"))
    out = meter.outcome("ok", 200)
    assert (out.input_tokens, out.output_tokens, out.text) == (12, 5, "Paris")


def test_a_tier_that_reports_no_usage_is_billed_on_our_count() -> None:
    meter = Meter(time.perf_counter(), counted_input=37)
    for piece in ("The", " capital", " is", " Paris"):
        meter.add(chunk(piece))
    meter.add(chunk(finish="length"))
    out = meter.outcome("ok", 200)
    assert (out.input_tokens, out.output_tokens) == (37, 4)  # the counted prompt, a token per content chunk
    cancelled = Meter(time.perf_counter(), counted_input=37)
    cancelled.add(chunk("One"))
    assert cancelled.outcome("cancelled", 499).output_tokens == 1


def test_a_tier_that_never_answered_bills_nothing() -> None:
    meter = Meter(time.perf_counter(), counted_input=37)
    meter.upstream_started()  # connected, then the server was gone: no chunk
    out = meter.outcome("error", 503, "upstream_unreachable", output_delivered=False)
    assert (out.input_tokens, out.output_tokens) == (0, 0)
