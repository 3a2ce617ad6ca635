"""Structured output through the gateway: `response_format` validated, passed to the tiers, enforced by our engine.

With the stub upstream: a bad response_format is a 400 in OpenAI's shape naming it, before anything is routed or
billed; a remote tier gets the format exactly as it was sent. With `tiergate serve` on the real SmolLM2 and the
official `openai` client: json_schema answers to 50 ShareGPT first turns, sent at once, all validate; a streamed
answer concatenates to valid JSON; the cache never serves a JSON answer to a prose request; a schema the engine
cannot compile is a 400 naming response_format, billed nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from assets.datasets import sharegpt_conversations
from gateway.settings import Settings
from quotas.ledger import Ledger
from tests.conftest import Gateway
from tests.served import serve_beside_a_stub

# nested, and bounded everywhere (strings, arrays, integers), so that a complete answer fits in MAX_TOKENS
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["topic", "meta", "tags"],
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "meta": {"type": "object", "additionalProperties": False, "required": ["language", "difficulty"],
                 "properties": {"language": {"type": "string", "enum": ["en", "zh", "es", "fr", "de", "other"]},
                                "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}}},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 12}},
    },
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "triage", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 160
SYSTEM = {"role": "system", "content": "Classify the user's message. Reply with JSON only."}
MSG = [{"role": "user", "content": "Hello"}]


def test_a_bad_response_format_is_a_400_naming_it_and_billed_nothing(gateway: Gateway) -> None:
    deep: Any = {}
    for _ in range(40):
        deep = {"items": deep}
    bad = [
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "two words", "schema": {}}},
         "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 40_000]}}},
         "response_format.json_schema.schema"),
    ]
    with gateway.client(gateway.tenant_key) as c:
        for fmt, param in bad:
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "response_format": fmt})
            assert r.status_code == 400, (fmt, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert gateway.stub.requests == []  # nothing was routed
    assert all(row.price_usd == 0 for row in gateway.ledger_rows())


def test_a_remote_tier_gets_the_format_as_it_was_sent(gateway: Gateway) -> None:
    fmt = {"type": "json_schema", "json_schema": {
        "name": "with-defaults", "description": "as sent", "strict": False,
        "schema": {"type": "object", "properties": {"note": {"type": ["string", "null"], "default": None}},
                   "x-vendor": {"kept": [1, 2.5, True]}}}}
    with gateway.client(gateway.tenant_key) as c:
        for sent in (fmt, {"type": "json_object"}, {"type": "text"}):
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "response_format": sent})
            assert r.status_code == 200, r.text
            assert gateway.stub.requests[-1]["response_format"] == sent


# ---- the real model behind `tiergate serve` ----

TIERS = """
tiers:
  small:
    backend: openai
    model: stub-small
    urls: ["{stub}"]
    price_per_1k_input: "0.0001"
    price_per_1k_output: "0.0002"
    hardware_cost_per_hour: "0.01"
    context_limit: 4096
  mid:
    backend: openai
    model: stub-mid
    urls: ["{stub}"]
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "1"
    context_limit: 4096
  full:
    backend: local
    model: smollm2-135m-instruct
    max_num_seqs: 16
    threads: 1                        # two threads on two cores stall whenever another process runs there
    price_per_1k_input: "0.0003"
    price_per_1k_output: "0.0006"
    hardware_cost_per_hour: "0.08"
    context_limit: 2048
"""
# no level to move to: the 50-request burst would otherwise raise the ladder, which sheds or remaps `full`
LADDER = "levels:\n  - {level: 0, name: normal}\n"


@dataclass
class Served:
    url: str
    data_dir: Path
    demo_key: str

    def ledger_rows(self) -> list[Any]:
        ledger = Ledger(Settings(data_dir=self.data_dir).ledger_db)
        try:
            return ledger.rows()
        finally:
            ledger.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("structured")
    with serve_beside_a_stub(tmp, TIERS, LADDER) as (url, started):
        yield Served(url, tmp / "data", started.demo_key)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.demo_key, max_retries=0, timeout=300) as sdk:
        yield sdk


@pytest.mark.model
def test_50_sharegpt_answers_validate_against_a_nested_schema(served: Served) -> None:
    questions = [c[0]["content"][:300] for c in sharegpt_conversations(limit=50)]
    assert len(questions) == 50
    aclient = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=served.demo_key, max_retries=0, timeout=600)

    async def ask(question: str) -> Any:
        return await aclient.chat.completions.create(
            model="full", messages=[SYSTEM, {"role": "user", "content": question}], temperature=0,
            max_tokens=MAX_TOKENS, response_format=FORMAT)  # type: ignore[arg-type]

    async def all_at_once() -> list[Any]:
        async with aclient:
            return await asyncio.gather(*(ask(q) for q in questions))

    answers = asyncio.run(all_at_once())
    for question, answer in zip(questions, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (question, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)  # raises, naming what is wrong


@pytest.mark.model
def test_a_streamed_answer_concatenates_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="full", messages=[SYSTEM, {"role": "user", "content": "My printer jams on every page. Help?"}],
        temperature=0, max_tokens=MAX_TOKENS, response_format=FORMAT, stream=True)  # type: ignore[arg-type]
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and len([p for p in parts if p]) > 1  # really streamed, piece by piece
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


@pytest.mark.model
def test_the_cache_never_serves_a_json_answer_to_a_prose_request(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    chat = client.chat.completions.with_raw_response
    kwargs: dict[str, Any] = {"model": "full", "messages": messages, "temperature": 0, "max_tokens": 48}
    first = chat.create(response_format={"type": "json_object"}, **kwargs)
    again = chat.create(response_format={"type": "json_object"}, **kwargs)
    prose = chat.create(**kwargs)
    assert first.headers["x-tiergate-cache"] == "miss" and again.headers["x-tiergate-cache"] == "hit"
    json_text = again.parse().choices[0].message.content
    assert isinstance(json.loads(json_text), dict)
    assert prose.headers["x-tiergate-cache"] == "miss"
    assert prose.parse().choices[0].message.content != json_text


@pytest.mark.model
def test_a_schema_the_engine_cannot_compile_is_a_400_billed_nothing(served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                  "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {served.demo_key}"}, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "full", "messages": MSG, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format" and "strin" in r.json()["error"]["message"]
    rid = r.headers["x-tiergate-request-id"]
    deadline = time.time() + 10
    while not (rows := [row for row in served.ledger_rows() if row.request_id == rid]) and time.time() < deadline:
        time.sleep(0.1)  # the ledger commits in groups, off the request's path
    assert [(row.status, row.http_status, row.price_usd) for row in rows] == [("error", 400, 0)]
