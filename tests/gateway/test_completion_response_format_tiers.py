"""`response_format` on a text completion (POST /v1/completions) is honoured by tiers whose server's /v1/completions
takes it (our engines, `dialect: vllm`); OpenAI's legacy completions API has no such field, so a plain `openai` tier
got it and either refused it or dropped the tenant's JSON constraint unsaid. Now such a tier never gets one: named, it
is a 400 naming `response_format` before anything is spent; `auto` passes it over; a plan with no tier that can is
refused by name. `{"type": "text"}` asks for nothing: it goes anywhere, left out of the body. On chat,
`response_format` is OpenAI's own field and still reaches every tier. Through a real gateway in front of stubs that
record the bodies they get."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.gateway.dialect_tiers import dialect_gateway, key_of

JSON = {"type": "json_object"}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


@pytest.fixture
def gw(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    with dialect_gateway(tmp_path, prepared_models) as gateway:
        yield gateway


def complete(gw: Gateway, body: dict[str, Any], key: str | None = None, path: str = "/v1/completions") -> Any:
    with gw.client(key or gw.tenant_key) as c:
        return c.post(path, json={"max_tokens": 3, "prompt": "hello", **body})


@pytest.mark.parametrize("fmt", [JSON, SCHEMA], ids=["json_object", "json_schema"])
def test_a_completions_response_format_named_for_a_plain_openai_tier_is_refused_by_name(
        gw: Gateway, fmt: dict[str, Any]) -> None:
    r = complete(gw, {"model": "mid", "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "unsupported_parameter", error
    assert error["type"] == "invalid_request_error" and "'mid'" in error["message"]
    assert gw.stub.requests == [] and gw.ledger_rows() == []  # nothing sent, nothing reserved or billed
    served = complete(gw, {"model": "full", "response_format": fmt})  # a vLLM's /v1/completions takes it
    assert served.status_code == 200, served.text
    assert gw.stub.requests[-1]["response_format"] == fmt and gw.stub.requests[-1]["model"] == "stub-full"


def test_text_goes_anywhere_and_is_left_out_and_chat_keeps_its_response_format(gw: Gateway) -> None:
    r = complete(gw, {"model": "mid", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    assert "response_format" not in gw.stub.requests[-1]  # a strict legacy server would refuse the field
    chat = complete(gw, {"model": "mid", "response_format": JSON, "messages": [{"role": "user", "content": "hi"}],
                         "prompt": None}, path="/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    assert gw.stub.requests[-1]["response_format"] == JSON and "messages" in gw.stub.requests[-1]


def test_auto_keeps_a_completions_response_format_off_a_plain_openai_tier(gw: Gateway) -> None:
    plain = complete(gw, {"model": "auto"})
    assert plain.headers["x-tiergate-tier"] == "mid"  # the plan's default
    formatted = complete(gw, {"model": "auto", "response_format": JSON})
    assert formatted.status_code == 200, formatted.text
    assert formatted.headers["x-tiergate-tier"] == "small"  # the cheapest that takes it, as with top_k
    assert gw.mute.requests[-1]["response_format"] == JSON  # type: ignore[attr-defined]
    assert [b["model"] for b in gw.stub.requests] == ["stub-mid"]  # the first request's only


def test_a_plan_with_no_tier_that_takes_it_is_refused_by_name(gw: Gateway) -> None:
    r = complete(gw, {"model": "auto", "response_format": JSON}, key_of(gw, "plain"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert gw.stub.requests == []

