"""The headers chat reads that /v1/embeddings cannot use (gateway/embeddings_service.py): an embedding is never
cached, so no data version scopes it, and no tier serves it, so no session routes it. A client that sets them on
every request (the SDKs' `default_headers`) keeps its embeddings: they are accepted and not read. But a data version
chat refuses is refused here too: an `X-Tiergate-Data-Version` of 300 `!` was a 400 on chat and a 200 here."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway

BODY = {"model": "all-MiniLM-L6-v2", "input": "hello there"}
CHAT = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}


def test_a_data_version_chat_refuses_is_refused_on_embeddings(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for route, body in (("/v1/embeddings", BODY), ("/v1/chat/completions", CHAT)):
            r = c.post(route, json=body, headers={"X-Tiergate-Data-Version": "!" * 300})
            assert r.status_code == 400, (route, r.text[:300])
            error = r.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (
                "x-tiergate-data-version", "invalid_header", "invalid_request_error"), error
        assert not gateway.ledger_rows()  # nothing was embedded or billed


@pytest.mark.parametrize(("name", "value"), [("X-Tiergate-Data-Version", "v2"), ("X-Tiergate-Session", "s1"),
                                             ("X-Tiergate-Data-Version", "")])
def test_a_valid_header_embeddings_do_not_read_is_accepted(gateway: Gateway, name: str, value: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/embeddings", json=BODY, headers={name: value})
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["data"]) == 1
