"""Tool results at our engine's server: the prompt holds no ids (wire/tool_calls.py renders each result after the
calls, in a user turn of results), so a result reads as the answer to the call at its place. Results sent in another
order than their calls (as the calls finished) are put in the calls' order; each was read as another call's answer.
A result that answers no call of the assistant message before it (an id it did not make, one answered already) is a
400 naming its `tool_call_id`, as OpenAI refuses it, before anything is rendered or generated: it was rendered as
the answer to whichever call stood at its place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.fakes import ScriptedRunner, prompt_text, scripted_server

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def call(call_id: str, city: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": f'{{"city": "{city}"}}'}}


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


ASKED = [{"role": "user", "content": "Weather in Paris and Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [call("c_paris", "Paris"), call("c_oslo", "Oslo")]}]


@pytest.fixture
def served() -> Iterator[tuple[str, ScriptedRunner]]:
    runner = ScriptedRunner(reply="Done.", max_model_len=4096, num_kv_blocks=512)  # the tools' preamble is long
    with scripted_server(runner) as url:
        yield url, runner


def post(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS,
                                                          "max_tokens": 2}, timeout=30)


def test_results_sent_as_their_calls_finished_are_read_in_the_calls_order(
        served: tuple[str, ScriptedRunner]) -> None:
    url, runner = served
    r = post(url, [*ASKED, result("c_oslo", "snow"), result("c_paris", "sun")])
    assert r.status_code == 200, r.text
    prompt = prompt_text(runner.steps[0].seqs[0])
    assert "<tool_response>\nsun\n</tool_response>\n<tool_response>\nsnow\n</tool_response>" in prompt


@pytest.mark.parametrize(("messages", "index"), [
    ([*ASKED, result("c_paris", "sun"), result("c_rome", "rain")], 3),  # an id the calls did not make
    ([*ASKED, result("c_paris", "sun"), result("c_paris", "rain")], 3),  # answered already
    ([ASKED[0], result("c_paris", "sun")], 1),  # after no call at all
    ([*ASKED, result("c_paris", "sun"), result("c_oslo", "snow"), {"role": "user", "content": "And Rome?"},
      result("c_paris", "rain")], 5),  # a result of calls answered before another turn
])
def test_a_result_that_answers_no_call_is_a_400_naming_its_id(served: tuple[str, ScriptedRunner],
                                                              messages: list[dict[str, Any]], index: int) -> None:
    url, runner = served
    r = post(url, messages)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"messages.{index}.tool_call_id" and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value"  # as the gateway's refusal of it (gateway/pipeline/handle.py)
    assert not runner.steps  # nothing generated
    assert post(url, [*ASKED, result("c_paris", "sun"), result("c_oslo", "snow")]).status_code == 200
