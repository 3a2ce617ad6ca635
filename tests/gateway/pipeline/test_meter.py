"""The meter bills what the tier reports, and our own count only when a tier that answered reported nothing."""

from __future__ import annotations

import time
import tracemalloc

from gateway.pipeline.meter import Meter, Outcome


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


def _seconds_to_add(chunks: list[dict]) -> tuple[float, Outcome]:
    meter = Meter(time.perf_counter())
    t0 = time.perf_counter()
    for c in chunks:
        meter.add(c)
    elapsed = time.perf_counter() - t0
    return elapsed, meter.outcome("ok", 200)


def test_a_tool_calls_arguments_are_joined_in_time_linear_in_the_answer() -> None:
    """A call's arguments come a token at a time, and the tenant chooses how long they are (up to the tier's context:
    32k tokens and more on a remote tier). Each piece appended to the string so far copied it, on the event loop:
    64,000 pieces took 0.5-2.5 s there, where as many pieces of content take a few hundredths."""
    n = 128_000
    calls = [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, **({"id": "call_1", "type": "function"} if i == 0 else {}),
         "function": {"name": "f", "arguments": "abcd"} if i == 0 else {"arguments": "abcd"}}]}}]}
        for i in range(n)]
    text = [chunk("abcd") for _ in range(n)]
    _seconds_to_add(text[:1000])  # warm
    # the best of three each: a pause of the machine (another test's process, a GC) lengthens one run, not all three
    as_text = min(_seconds_to_add(text)[0] for _ in range(3))
    as_calls = min(_seconds_to_add(calls)[0] for _ in range(3))
    out = _seconds_to_add(calls)[1]
    assert out.tool_calls[0]["function"] == {"name": "f", "arguments": "abcd" * n}
    # quadratic joining took 0.5-2.5 s at half these pieces (2-10 s here); linear takes about as long as the text,
    # up to 3.4x it on a machine running more processes than it has cores (a full run beside other tests)
    assert as_calls < 5 * as_text + 0.1, (as_calls, as_text)


def test_a_stream_whose_text_nothing_reads_is_not_kept() -> None:
    # `keep_text` False (handle.py: no cache store, Idempotency-Key, cascade check or shadow reads it): only the counts
    # are kept. The pieces were all held for the request's life: 20,000 chunks, about 1.3 MB (60 bytes a chunk)
    n = 20_000
    tracemalloc.start()
    try:
        meter = Meter(time.perf_counter(), counted_input=10, output_cap=n, keep_text=False)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            meter.add(chunk(f" w{i % 1000:03d}"))
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held < 100_000, held  # the few objects an attempt keeps, not a piece a chunk
    out = meter.outcome("ok", 200)
    assert (out.text, out.output_tokens, meter.text_chunks) == ("", n, n)  # billed a token a chunk, as before


def test_the_text_is_kept_by_default() -> None:
    meter = Meter(time.perf_counter())
    for piece in ("Par", "is"):
        meter.add(chunk(piece))
    assert meter.outcome("ok", 200).text == "Paris"
