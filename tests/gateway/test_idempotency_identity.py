"""Idempotency-Key records are per tenant, but an answer is per identity, as the cache scopes it (the key's roles, and
the end user where the plan isolates users): another key of the tenant with other roles that reuses a key and its
body gets a 422, never the first identity's answer replayed free; the same identity's retry still replays (chat and
embeddings). The records in SQLite (embedded), as tests/gateway/test_idempotency_api.py's first store."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Gateway
from tests.stubs import REPLY

REPLAY = "x-tiergate-idempotent-replay"
BODY = {"model": "mid", "messages": [{"role": "user", "content": "What is Alice's salary?"}], "max_tokens": 4,
        "temperature": 0}


def post(gw: Gateway, key: str, body: dict[str, Any], idem: str, path: str = "/v1/chat/completions"
         ) -> httpx.Response:
    with gw.client(key) as c:
        return c.post(path, json=body, headers={"Idempotency-Key": idem})


def test_another_identity_of_the_tenant_never_gets_the_stored_answer(gateway: Gateway) -> None:
    """The hunter's case: plan isolate_users, keys with roles `hr` and `public`, the same key and body."""
    gateway.store.create_tenant("clinic", "private")
    _, hr = gateway.store.issue_key("clinic", name="hr", roles=("hr",))
    _, public = gateway.store.issue_key("clinic", name="public", roles=("public",))
    first = post(gateway, hr, BODY, "order-42")
    assert first.status_code == 200 and first.headers.get(REPLAY) is None
    text = first.json()["choices"][0]["message"]["content"]
    assert text and REPLY.startswith(text)
    rows, calls = len(gateway.ledger_rows()), len(gateway.stub.requests)

    other = post(gateway, public, BODY, "order-42")
    assert other.status_code == 422, other.text
    assert other.headers.get(REPLAY) is None
    error = other.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
    assert first.json()["id"] not in other.text and text not in other.text  # nothing of hr's answer
    assert len(gateway.stub.requests) == calls and len(gateway.ledger_rows()) == rows  # not run, not written

    again = post(gateway, hr, BODY, "order-42")  # the same identity's retry: the same answer, charged nothing
    assert again.status_code == 200 and again.headers[REPLAY] == "true"
    assert again.json()["id"] == first.json()["id"] and again.json()["choices"] == first.json()["choices"]
    assert len(gateway.stub.requests) == calls and len(gateway.ledger_rows()) == rows

    # another key with the same roles is the same identity, as for the cache: it replays
    _, hr2 = gateway.store.issue_key("clinic", name="hr2", roles=("hr",))
    same = post(gateway, hr2, BODY, "order-42")
    assert same.status_code == 200 and same.headers[REPLAY] == "true" and same.json()["id"] == first.json()["id"]

    # the public key with its own Idempotency-Key runs its own request
    own = post(gateway, public, BODY, "order-43")
    assert own.status_code == 200 and own.headers.get(REPLAY) is None and own.json()["id"] != first.json()["id"]


def test_roles_count_on_a_plan_that_shares_answers_among_users(gateway: Gateway) -> None:
    """Without isolate_users the roles still scope an answer (the cache's identity is the roles alone)."""
    _, reader = gateway.store.issue_key("acme", name="reader", roles=("reader",))
    first = post(gateway, gateway.tenant_key, BODY, "k-1")
    assert first.status_code == 200
    other = post(gateway, reader, BODY, "k-1")
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert first.json()["id"] not in other.text
    again = post(gateway, gateway.tenant_key, BODY, "k-1")
    assert again.status_code == 200 and again.headers[REPLAY] == "true" and again.json()["id"] == first.json()["id"]


def test_embeddings_too(gateway: Gateway) -> None:
    _, reader = gateway.store.issue_key("acme", name="reader", roles=("reader",))
    body = {"model": "all-MiniLM-L6-v2", "input": "How do I reset my password?"}
    first = post(gateway, gateway.tenant_key, body, "emb-1", "/v1/embeddings")
    assert first.status_code == 200
    other = post(gateway, reader, body, "emb-1", "/v1/embeddings")
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    again = post(gateway, gateway.tenant_key, body, "emb-1", "/v1/embeddings")
    assert again.status_code == 200 and again.headers[REPLAY] == "true"
