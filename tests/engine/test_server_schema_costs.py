"""The engine's server refuses, at its request validation (wire/schema_costs.py, shared with the gateway), a schema
that llguidance compiles in a millisecond and fails on at the first token: a pattern repeating a million times held
the step loop 0.75 s and 185 MiB for the whole batch before its sequence failed, a schema referring to itself in place
failed at once. Now a 400 naming the keyword, before the engine checks, compiles or schedules anything."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread

MSG = [{"role": "user", "content": "hi"}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": schema_format({"type": "string", "pattern": "^a{1000000}$"})},
     "response_format.json_schema.schema.pattern"),
    ({"response_format": schema_format({"anyOf": [{"type": "null"}, {"allOf": [{"$ref": "#/anyOf/1"}]}]})},
     "response_format.json_schema.schema.anyOf.1.allOf.0.$ref"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string", "pattern": "^(x+){5000}$"}}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters.properties.a.items.pattern"),
])
def test_the_engine_refuses_the_schema_before_it_takes_the_request(body: dict[str, Any], param: str) -> None:
    eng = LLMEngine(ScriptedRunner(reply="{}", max_model_len=4096, num_kv_blocks=512), CharTokenizer())
    taken: list[str] = []
    for name in ("validate", "compiled_grammar", "generate"):
        real = getattr(eng, name)
        setattr(eng, name, lambda *a, _real=real, _name=name, **kw: taken.append(_name) or _real(*a, **kw))
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, **body}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert taken == []
        ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2},
                        timeout=30)
        assert ok.status_code == 200 and "validate" in taken, ok.text  # the spies see a request the engine takes
    finally:
        server.stop()
        eng.shutdown()
