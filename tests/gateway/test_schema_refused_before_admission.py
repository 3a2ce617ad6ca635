"""A response_format or tool schema that a grammar could only fail on (a pattern repeating a million times, a schema
that refers to itself in place) is refused by the gateway's validation: a 400 naming the keyword, before any quota is
reserved and before any tier is called. Before, it passed every check, was admitted and routed, and failed only when
the engine reached its first token (400 `response_format_failed`, wire/schema_costs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]
REPEATS = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}
SELF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# 1,150 references, each to the one defined before (28.9 KB): counting its answer's length ran past Python's stack,
# a 500 with a traceback for every request (tests/wire/test_schema_reference_chains.py)
CHAIN = {"a0": {"type": "string", "minLength": 1}} | {f"a{i}": {"$ref": f"#/a{i - 1}"} for i in range(1, 1150)} | {
    "type": "object", "properties": {"p": {"$ref": "#/a1149"}}, "required": ["p"]}


def reserves(gateway: Gateway) -> list[dict[str, Any]]:
    """Every reservation the gateway asks its quotas for from now on (the keyword arguments)."""
    quotas = gateway.app.state.services.pipeline.reserve.quotas
    real, asked = quotas.reserve, []

    async def spy(**kw: Any) -> Any:
        asked.append(kw)
        return await real(**kw)

    quotas.reserve = spy
    return asked


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REPEATS}}},
     "response_format.json_schema.schema.properties.a.pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": [{"$ref": "#"}]}}}},
     "response_format.json_schema.schema.allOf.0.$ref"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SELF}}], "tool_choice": "required"},
     "tools.0.function.parameters.$defs.a.$ref"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": CHAIN}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
])
def test_a_schema_a_grammar_can_only_fail_on_is_refused_before_admission(gateway: Gateway, body: dict[str, Any],
                                                                        param: str) -> None:
    asked = reserves(gateway)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert error["message"].startswith(f"{param}: "), error
        ok = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})  # the spy sees what is admitted
        assert ok.status_code == 200, ok.text
    assert len(asked) == 1  # the good request's alone: the refused one reserved nothing
    assert len(gateway.stub.requests) == 1 and "response_format" not in gateway.stub.requests[0]  # nor was routed
