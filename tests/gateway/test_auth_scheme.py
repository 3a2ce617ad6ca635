"""An Authorization header that carries no bearer key (another scheme, or none after `Bearer`) is refused by name
(401, param `authorization`; gateway/auth.py), whether or not X-API-Key is sent beside it. It was passed over for
X-API-Key: `Authorization: Basic …` with a valid X-API-Key was that key's request, while alone it was a 401, so a
proxy in front that reads Authorization took the request for one caller and the gateway for another."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Gateway

CHAT = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}
NOT_BEARER = ["Basic Zm9vOmJhcg==", "Bearer", "Token {key}", "{key}"]  # the last two: a key under the wrong scheme


def _refused(r: httpx.Response, *keys: str) -> None:
    assert r.status_code == 401, r.text[:300]
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "authentication_error",
                                  "param": "authorization", "code": "missing_api_key"}}
    for key in keys:  # the header's value is never echoed, nor the key's secret (all after `tg-<id>-`, which may
        # itself hold a `-`: its last piece alone was once the one letter "A", found in the message's "Authorization")
        assert key not in r.text and key.split("-", 2)[-1] not in r.text


@pytest.mark.parametrize("authorization", NOT_BEARER)
def test_an_authorization_without_a_bearer_key_is_refused_beside_x_api_key_as_alone(gateway: Gateway,
                                                                                     authorization: str) -> None:
    tenant, admin = gateway.tenant_key, gateway.admin_key
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        value = authorization.format(key=tenant)
        for headers in ({"authorization": value, "x-api-key": tenant}, {"authorization": value}):
            _refused(c.get("/v1/models", headers=headers), tenant)
            _refused(c.post("/v1/chat/completions", json=CHAT, headers=headers), tenant)
        value = authorization.format(key=admin)
        _refused(c.get("/admin/tenants", headers={"authorization": value, "x-api-key": admin}), admin)
        # /health never answers 401: such a request gets the short answer, as one without a key
        assert (c.get("/health", headers={"authorization": value, "x-api-key": admin}).json()
                == c.get("/health").json())
    assert not gateway.stub.requests and not gateway.ledger_rows()


def test_x_api_key_alone_or_beside_an_empty_authorization_or_the_same_bearer_key_is_served(gateway: Gateway) -> None:
    key = gateway.tenant_key
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for headers in ({"x-api-key": key}, {"authorization": "", "x-api-key": key},
                        {"authorization": f"Bearer {key}", "x-api-key": key}, {"authorization": f"bearer {key}"}):
            assert c.get("/v1/models", headers=headers).status_code == 200, headers
