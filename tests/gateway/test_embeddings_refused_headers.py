"""What chat reads and embeddings cannot is refused by name on /v1/embeddings (gateway/embeddings_service.py
`UNREAD_HEADERS`), never dropped: an embedding is never cached, so no data version scopes it, and no tier serves it,
so no session routes it. Both were ignored: an `X-Tiergate-Data-Version` of 300 `!` was a 400 on chat and a 200
here."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway

BODY = {"model": "all-MiniLM-L6-v2", "input": "hello there"}


@pytest.mark.parametrize(("name", "value"), [("X-Tiergate-Data-Version", "!" * 300),
                                             ("X-Tiergate-Data-Version", "v2"), ("X-Tiergate-Session", "s1")])
def test_a_header_embeddings_cannot_honour_is_refused_by_name(gateway: Gateway, name: str, value: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/embeddings", json=BODY, headers={name: value})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            name.lower(), "unsupported_parameter", "invalid_request_error"), error
        assert not gateway.ledger_rows()  # nothing was embedded or billed
        # an empty one carries nothing, as on chat: served
        assert c.post("/v1/embeddings", json=BODY, headers={name: ""}).status_code == 200
