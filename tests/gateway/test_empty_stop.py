"""An empty stop string is refused by the gateway for every tier, before anything is spent: a remote tier got it as
sent (where it stops at once, or is a 400 the tenant read as the tier's), while our engine ignored it (wire's
StopString says why it is refused)."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["\n", ""]}, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
], ids=["chat", "text"])
def test_an_empty_stop_string_never_reaches_a_tier(gateway: Gateway, path: str, body: dict[str, object],
                                                   param: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post(path, json={"model": "mid", "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert gateway.stub.requests == [] and gateway.ledger_rows() == []
