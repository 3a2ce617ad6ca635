"""A json_schema response_format's `description` reaches the model on our engines: a line at the end of the system
turn (wire/tool_calls.py's `format_line`, through `preamble`), so the model is told what its constrained answer is for
(before, the grammar took the schema and the description was accepted and dropped). Only where that format is the
answer: a required or named tool call replaces it, and then the prompt is the tools' as before. A request without a
description renders byte for byte as before; a description that spells the template's markers is read as text; the
gateway counts the prompt the engine tokenizes; the cache's scope tells two descriptions apart.

Over real HTTP, with a scripted runner and the prompt ids it was handed (tests/engine/test_prompt_special_tokens.py's
ChatML tokenizer, and SmolLM2's own for the gateway's count).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from cache.request_key import context_hash
from gateway.ladder.apply import NORMAL
from gateway.pipeline.prompt import PromptStage
from tests.engine.fakes import ScriptedRunner
from tests.engine.test_prompt_special_tokens import (
    FORGED,
    TOOLS,
    assert_read_as_text,
    body,
    chatml_tokenizer,
    serve,
    served_ids,
)
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest
from wire.tool_calls import tools_preamble
from wire.tools import Tool

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "The city the user asks about, spelled as on a map."
LINE = f'Your answer is JSON in the response format "place": {DESCRIPTION}'
BRIEF = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the Louvre?"}]
ASKED = [{"role": "user", "content": "Where is the Louvre?"}]
# the prompt after its system turn (this template writes no line end after a role: Jinja's trim_blocks)
TURNS = "<|im_start|>userWhere is the Louvre?<|im_end|>\n<|im_start|>assistant\n"


def json_schema(**spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, **spec}}


@pytest.fixture(scope="module")
def chatml() -> Iterator[tuple[Any, str, ScriptedRunner]]:
    tokenizer = chatml_tokenizer()
    for url, runner in serve(tokenizer):
        yield tokenizer, url, runner


def prompt(chatml: tuple[Any, str, ScriptedRunner], messages: list[dict[str, Any]], **fields: Any) -> str:
    """The prompt the engine handed its runner, as text (one id a byte or a marker: decoded exactly)."""
    tokenizer, url, runner = chatml
    return tokenizer.decode(served_ids(url, runner, body(messages, **fields)), skip_special_tokens=False)


@pytest.mark.parametrize(("messages", "system"), [(BRIEF, f"Be brief.\n\n{LINE}"), (ASKED, LINE)],
                         ids=["after the system message", "a system turn of its own"])
def test_a_formats_description_is_told_to_the_model_in_the_system_turn(
        chatml: tuple[Any, str, ScriptedRunner], messages: list[dict[str, Any]], system: str) -> None:
    got = prompt(chatml, messages, response_format=json_schema(description=DESCRIPTION, strict=True))
    assert got == f"<|im_start|>system{system}<|im_end|>\n{TURNS}"


REQUIRED_TOOLS = tools_preamble([Tool.model_validate(TOOLS[0])])


@pytest.mark.parametrize(("fields", "system"), [
    ({}, "Be brief."),
    ({"response_format": {"type": "text"}}, "Be brief."),
    ({"response_format": {"type": "json_object"}}, "Be brief."),
    ({"response_format": json_schema()}, "Be brief."),
    ({"response_format": json_schema(description=None)}, "Be brief."),
    ({"response_format": json_schema(description="")}, "Be brief."),
    ({"response_format": json_schema(description=" \n ")}, "Be brief."),
    # the answer is the call, not the format's JSON: the tools' prompt as it was
    ({"response_format": json_schema(description=DESCRIPTION), "tools": TOOLS, "tool_choice": "required"},
     f"Be brief.\n\n{REQUIRED_TOOLS}"),
    ({"response_format": json_schema(description=DESCRIPTION), "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, f"Be brief.\n\n{REQUIRED_TOOLS}"),
], ids=["no format", "text", "json_object", "no description", "null", "empty", "blank", "required call",
        "named call"])
def test_without_a_description_to_tell_the_prompt_is_as_before(
        chatml: tuple[Any, str, ScriptedRunner], fields: dict[str, Any], system: str) -> None:
    assert prompt(chatml, BRIEF, **fields) == f"<|im_start|>system{system}<|im_end|>\n{TURNS}"


def test_tool_choice_none_leaves_the_format_the_answer_and_tells_it(chatml: tuple[Any, str, ScriptedRunner]) -> None:
    got = prompt(chatml, BRIEF, response_format=json_schema(description=DESCRIPTION), tools=TOOLS, tool_choice="none")
    assert got == f"<|im_start|>systemBe brief.\n\n{LINE}<|im_end|>\n{TURNS}"


def test_a_description_spelling_the_templates_markers_is_read_as_text(chatml: tuple[Any, str, ScriptedRunner]) -> None:
    tokenizer, url, runner = chatml
    forged = (BRIEF, {"response_format": json_schema(description=FORGED)})
    harmless = (BRIEF, {"response_format": json_schema(description="Go")})
    assert_read_as_text(tokenizer, url, runner, forged, harmless)


def test_the_cache_scope_tells_two_descriptions_apart() -> None:
    """The answer may differ with the description now: two requests differing only in it are never one scope."""
    def scope(**spec: Any) -> str:
        req = ChatCompletionRequest.model_validate(body(ASKED, response_format=json_schema(**spec)))
        return context_hash(req.model_dump(mode="json", exclude_none=True))  # the body the gateway's cache reads

    assert len({scope(), scope(description=DESCRIPTION), scope(description="Where it is.")}) == 3


@pytest.fixture(scope="module")
def smollm2(prepared_models: Path) -> Iterator[tuple[str, ScriptedRunner]]:
    yield from serve(AutoTokenizer.from_pretrained(prepared_models / "smollm2-135m-instruct"))


@pytest.mark.model
def test_the_gateways_count_is_the_engines_prompt(smollm2: tuple[str, ScriptedRunner], prepared_models: Path) -> None:
    """What the gateway reserves for a local tier (gateway/pipeline/prompt.py, through `preamble`) is the prompt the
    engine tokenized, the description's line and its text that spells markers included."""
    url, runner = smollm2
    stage = PromptStage(models_dir=prepared_models, default_max_tokens=16)
    tier = TierSpec.model_validate({"name": "mid", "backend": "local", "model": "smollm2-135m-instruct",
                                    "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                    "hardware_cost_per_hour": "1", "context_limit": 8192})
    try:
        for messages in (BRIEF, ASKED):
            for description in (DESCRIPTION, FORGED, None):
                payload = body(messages, response_format=json_schema(description=description))
                counted = asyncio.run(stage.measure(ChatCompletionRequest.model_validate(payload), tier, NORMAL))
                assert counted.num_tokens == len(served_ids(url, runner, payload)), (messages, description)
    finally:
        stage.threads.close()
