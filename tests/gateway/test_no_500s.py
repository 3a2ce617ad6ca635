"""No input makes the gateway answer 500: arbitrary JSON and mutated valid bodies get OpenAI-shaped 4xx
(or a 200), and nothing refused is charged."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Gateway

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "stop", "seed", "user", "n", "priority", "presence_penalty", "frequency_penalty"]
VALID = {"model": "mid", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def check(gateway: Gateway, body: bytes) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text, body[:200])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON)
def test_arbitrary_json_never_500s(gateway: Gateway, body: object) -> None:
    check(gateway, json.dumps(body).encode())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_one_wrong_field_never_500s(gateway: Gateway, field: str, value: object) -> None:
    check(gateway, json.dumps(VALID | {field: value}).encode())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_never_500s(gateway: Gateway, raw: bytes) -> None:
    check(gateway, raw)
