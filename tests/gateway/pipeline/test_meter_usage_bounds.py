"""A tier's usage is checked before it is billed: a field that is not a plausible count is billed on our own count,
and the output never past the `max_tokens` the gateway sent (what the reservation covers)."""

from __future__ import annotations

import time

import pytest

from gateway.pipeline.meter import Meter
from tests.gateway.pipeline.test_meter import chunk


def billed(usage: dict, *, pieces: tuple[str, ...] = ("Par", "is"), counted: int = 12,
           cap: int | None = 4, status: str = "ok") -> tuple[int, int]:
    kwargs = {} if cap is None else {"output_cap": cap}
    meter = Meter(time.perf_counter(), counted_input=counted, **kwargs)
    meter.upstream_started()
    for piece in pieces:
        meter.add(chunk(piece))
    meter.add(chunk(usage=usage, finish="stop"))
    out = meter.outcome(status, 200)
    return out.input_tokens, out.output_tokens


def test_output_is_billed_at_most_the_cap_sent() -> None:
    assert billed({"prompt_tokens": 12, "completion_tokens": 4000}) == (12, 4)  # not 4000: max_tokens was 4
    assert billed({"prompt_tokens": 12, "completion_tokens": 3}) == (12, 3)  # under the cap: as reported
    # a tier that reports none and streams more chunks than it was asked for: still the cap
    assert billed({}, pieces=("a", "b", "c", "d", "e", "f")) == (12, 4)


@pytest.mark.parametrize("bad", [-4, -1, True, 2.5, "4000", "3", None, [3], float("nan"), float("inf"), 10**12])
def test_a_field_that_is_not_a_count_is_billed_on_our_count(bad: object) -> None:
    # output: one token a content chunk (2 here); prompt: the counted prompt (12)
    assert billed({"prompt_tokens": 12, "completion_tokens": bad}) == (12, 2)
    assert billed({"prompt_tokens": bad, "completion_tokens": 3}) == (12, 3)
    assert billed({"prompt_tokens": bad, "completion_tokens": bad}, cap=None) == (12, 2)


def test_negative_usage_never_lowers_the_bill() -> None:
    inp, out = billed({"prompt_tokens": -50, "completion_tokens": -4})
    assert inp >= 0 and out >= 0 and (inp, out) == (12, 2)


def test_an_integral_float_is_a_count() -> None:
    assert billed({"prompt_tokens": 12.0, "completion_tokens": 3.0}) == (12, 3)


def test_a_prompt_far_past_the_counted_one_is_not_believed() -> None:
    assert billed({"prompt_tokens": 2 * 12 + 1024 + 1, "completion_tokens": 3}) == (12, 3)
    assert billed({"prompt_tokens": 40, "completion_tokens": 3}) == (40, 3)  # a template's tokens: believed
    # nothing counted (an off-path call): no prompt to compare with, only the absurd is refused
    assert billed({"prompt_tokens": 5000, "completion_tokens": 3}, counted=0) == (5000, 3)


def test_a_bad_report_keeps_the_last_good_one() -> None:
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=8)
    meter.add(chunk("a", usage={"prompt_tokens": 11, "completion_tokens": 1}))
    meter.add(chunk("b", usage={"prompt_tokens": 11, "completion_tokens": 2}))
    meter.add(chunk(usage={"prompt_tokens": -1, "completion_tokens": "lots"}, finish="stop"))
    out = meter.outcome("ok", 200)
    assert (out.input_tokens, out.output_tokens) == (11, 2)


def test_no_cap_given_keeps_what_the_tier_reports() -> None:
    assert billed({"prompt_tokens": 12, "completion_tokens": 4000}, cap=None) == (12, 4000)


def test_an_answer_reported_as_zeros_is_billed_on_our_count() -> None:
    # some servers fill `usage` with zeros when they do not count: the answer streamed was not free
    assert billed({"prompt_tokens": 0, "completion_tokens": 0}) == (12, 2)
    assert billed({"prompt_tokens": 0, "completion_tokens": 0}, counted=0) == (0, 2)  # nothing counted to bill


def test_output_is_billed_at_least_a_token_per_content_chunk() -> None:
    assert billed({"prompt_tokens": 12, "completion_tokens": 1}, pieces=("a", "b", "c")) == (12, 3)
    assert billed({"prompt_tokens": 12, "completion_tokens": 1}, pieces=tuple("abcdef")) == (12, 4)  # the cap still


def test_a_prompt_below_the_counted_one_is_believed() -> None:
    # a remote model's tokenizer may need several times fewer tokens than the one counting: its word is billed
    assert billed({"prompt_tokens": 10, "completion_tokens": 2}, counted=5000) == (10, 2)
    assert billed({"prompt_tokens": 2000, "completion_tokens": 2}, counted=5000) == (2000, 2)


def test_log_probabilities_past_the_cap_end_the_answer() -> None:
    # a token has one entry: more entries than the cap (in chunks with no content, or all in one) are past it
    entry = {"token": "a", "logprob": -0.1, "bytes": None, "top_logprobs": []}
    meter = Meter(time.perf_counter(), counted_input=12, keep_logprobs=True, output_cap=4)
    meter.add({"choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": {"content": [entry] * 2}}]})
    assert not meter.overran
    assert meter.add({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [entry] * 3}}]}) == ("", None,
                                                                                                        False, [])
    assert meter.overran and len(meter.logprobs) == 2 and meter.outcome("ok", 200).text == "ab"


@pytest.mark.parametrize("reason", ["x" * 100_000, "stop\r\nx-injected: 1", {"a": 1}, ["stop"], 1, "Stop"])
def test_a_finish_reason_that_is_not_a_short_token_is_none(reason: object) -> None:
    # was kept as str(reason): a megabyte, or control characters, into the tenant's answer and the ledger row
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=4)
    meter.add({"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": reason}]})
    assert meter.outcome("ok", 200).finish_reason is None


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "content_filter", "abort"])
def test_a_finish_reason_that_is_a_token_is_kept(reason: str) -> None:
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=4)
    meter.add({"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": reason}]})
    assert meter.outcome("ok", 200).finish_reason == reason


def test_tool_call_chunks_are_not_counted_as_tokens_of_the_cap() -> None:
    # an engine may send several chunks of tool-call deltas for one token (ours: a call's last arguments and the next
    # call's header; a free answer's calls all at its end): within the cap's characters they are all relayed
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=2)
    meter.add({"choices": [{"index": 0, "delta": {"content": "Calling."}}]})
    for i in range(4):
        call = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        _, _, _, calls = meter.add({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
        assert calls and not meter.overran
    meter.add({"choices": [{"index": 0, "delta": {"content": " Done."}}]})
    assert not meter.overran
    assert meter.add({"choices": [{"index": 0, "delta": {"content": " More."}}]}) == ("", None, False, [])
    assert meter.overran and meter.outcome("ok", 200).text == "Calling. Done."


@pytest.mark.parametrize("end", [{"content": "."}, {"content": "", "tool_calls": [
    {"index": 0, "function": {"arguments": "}"}}]}, {"content": " end.", "tool_calls": None}])
def test_the_held_back_end_sent_with_the_finish_after_the_cap_is_relayed(end: dict) -> None:
    # a server that holds back the answer's end (a stop string's partial match, a parser's last arguments) sends it
    # with its finish reason after the cap's last token: no new token, the end of what was paid for. It was cut
    # (the answer ended "length", without its end)
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=3)
    for piece in ("a", "b", "c"):
        meter.add(chunk(piece))
    content, _, _, _ = meter.add({"choices": [{"index": 0, "delta": end, "finish_reason": "stop"}]})
    assert not meter.overran and content == (end.get("content") or "")
    out = meter.outcome("ok", 200)
    assert (out.text, out.finish_reason, out.output_tokens) == ("abc" + content, "stop", 3)


def test_text_past_the_held_back_end_is_past_the_cap() -> None:
    # once: the end's chunk is let through, not a second one, nor text without a finish reason
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=2)
    meter.add(chunk("a"))
    meter.add(chunk("b"))
    meter.add(chunk("c"))
    assert meter.overran and meter.outcome("ok", 200).text == "ab"
    meter = Meter(time.perf_counter(), counted_input=12, output_cap=2)
    for piece in ("a", "b"):
        meter.add(chunk(piece))
    meter.add(chunk("c", finish="length"))
    assert not meter.overran
    assert meter.add(chunk("d", finish="stop")) == ("", None, False, [])
    assert meter.overran and meter.outcome("ok", 200).text == "abc"
