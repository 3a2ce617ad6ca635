"""A header the gateway reads sent twice (gateway/request_headers.py): one that takes one value is refused by name
before anything is spent; Cache-Control's lines are joined. Both were read as their last line (and the key's check as
its first): `Idempotency-Key` keyed the request on the second of two keys, and `no-store` on a first line was lost."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import Gateway
from tests.gateway.test_cache_api import ask

MSG = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("name", ["Idempotency-Key", "X-Tiergate-Data-Version", "X-Tiergate-Session"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/embeddings"])
def test_a_single_value_header_sent_twice_is_refused_by_name(gateway: Gateway, name: str, route: str) -> None:
    body = {"model": "mid", "messages": MSG} if route.endswith("completions") else {
        "model": "all-MiniLM-L6-v2", "input": "hello there"}
    with gateway.client(gateway.tenant_key) as c:
        r = c.post(route, json=body, headers=[(name, "a"), ("content-type", "application/json"), (name, "b")])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "duplicate_header" and error["param"] == name.lower(), error
    assert not gateway.stub.requests and not gateway.ledger_rows()


def test_an_openai_organization_and_project_are_not_read(gateway: Gateway) -> None:
    """What the official client sends whenever OPENAI_ORG_ID or OPENAI_PROJECT_ID is set: a client pointed here from
    OpenAI with either exported is served (README: usage is split by tenant and key, never by these)."""
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0,
                       organization="org-1", project="proj_1") as sdk:
        answer = sdk.chat.completions.with_raw_response.create(model="mid", messages=MSG)  # type: ignore[arg-type]
    assert answer.http_response.status_code == 200
    sent = answer.http_response.request.headers
    assert sent["openai-organization"] == "org-1" and sent["openai-project"] == "proj_1"  # as the SDK sends them
    assert len(gateway.ledger_rows()) == 1


def test_cache_control_on_two_lines_is_read_whole(gateway: Gateway) -> None:
    r = ask(gateway, headers=[("cache-control", "no-store"), ("cache-control", "max-age=0")])  # type: ignore[arg-type]
    assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "bypass"  # max-age=0 is no-cache
    assert ask(gateway).headers["x-tiergate-cache"] == "miss"  # the no-store answer was not kept
    # a directive not honoured on either line is refused by name (tests/gateway/test_cache_control.py)
    r = ask(gateway, headers=[("cache-control", "no-store"), ("cache-control", "max-age=60")])  # type: ignore[arg-type]
    assert r.status_code == 400 and "'max-age=60'" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/models", "/admin/tenants", "/v1/usage"])
@pytest.mark.parametrize("name", ["Authorization", "X-API-Key"])
def test_the_keys_header_sent_twice_is_refused_on_every_route(gateway: Gateway, route: str, name: str) -> None:
    """The first of two was read and the second ignored: a valid key then any other was the valid key's request on
    every route but the model routes (what a proxy reading the last line took for one caller, the gateway took for
    another)."""
    key = gateway.admin_key if route.startswith("/admin") else gateway.tenant_key
    value = f"Bearer {key}" if name == "Authorization" else key
    with gateway.client(None) as c:
        r = c.get(route, headers=[(name, value), (name, value.replace(key[-4:], "0000"))])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "duplicate_header" and error["param"] == name.lower(), error
    with gateway.client(None) as c:  # sent once, it is the key
        assert c.get(route, headers=[(name, value)]).status_code == 200


@pytest.mark.parametrize("route", ["/v1/models", "/admin/tenants", "/v1/usage"])
def test_two_different_keys_in_the_two_key_headers_are_refused(gateway: Gateway, route: str) -> None:
    """Authorization was read and X-API-Key ignored when both came with different keys: a valid key beside any
    other was the valid key's request, whichever header a proxy in front read. The same key in both is one key."""
    key = gateway.admin_key if route.startswith("/admin") else gateway.tenant_key
    other = key.replace(key[-4:], "0000")
    with gateway.client(None) as c:
        for headers in ([("Authorization", f"Bearer {key}"), ("X-API-Key", other)],
                        [("Authorization", f"Bearer {other}"), ("X-API-Key", key)]):
            r = c.get(route, headers=headers)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "conflicting_api_keys", r.text
        assert c.get(route, headers=[("Authorization", f"Bearer {key}"), ("X-API-Key", key)]).status_code == 200


@pytest.mark.parametrize("key", ["", "k" * 256, "clé", "a\tb"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/embeddings"])
def test_an_idempotency_key_that_cannot_be_one_is_refused_before_the_body(gateway: Gateway, route: str,
                                                                          key: str) -> None:
    """Refused at the door, with the body unread: a body that is not even JSON gets the key's 400, not the body's
    (it was parsed first, and the key refused only then)."""
    with gateway.client(gateway.tenant_key) as c:
        r = c.post(route, content=b"{not json", headers={"Idempotency-Key": key.encode("utf-8"),
                                                        "content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_idempotency_key", "Idempotency-Key"), error
    assert not gateway.stub.requests and not gateway.ledger_rows()
