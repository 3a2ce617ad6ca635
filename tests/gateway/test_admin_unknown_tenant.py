"""An admin's filter naming a tenant the store does not have is a 404 `tenant_not_found` in OpenAI's shape, on the
key list and the usage report alike. Both answered 200 with nothing in them: a misspelt name (`Acme`, `acme `) or
one that could never be a tenant's (`a*`) read as a tenant without keys, or one that used nothing."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]
NOT_TENANTS = ["nope", "Acme", "acme ", "acme\n", "a*", "acm", "acme.x", "", "x" * 300]


@pytest.mark.parametrize("route", ["/admin/keys", "/admin/usage/report"])
def test_a_filter_naming_no_tenant_is_a_404_not_an_empty_answer(gateway: Gateway, route: str) -> None:
    with gateway.client(gateway.tenant_key) as c:  # acme has usage and a key: an empty answer would be wrong
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}).status_code == 200
    with gateway.client(gateway.admin_key) as admin:
        for name in NOT_TENANTS:
            for query in ({"tenant": name}, {"tenant": name, "format": "csv"}) if "usage" in route else \
                    ({"tenant": name},):
                r = admin.get(route, params=query)
                assert r.status_code == 404, (name, r.status_code, r.text[:200])
                error = r.json()["error"]
                assert (error["param"], error["code"], error["type"]) == (
                    "tenant", "tenant_not_found", "invalid_request_error"), r.text
        ours = admin.get(route, params={"tenant": "acme"})
        assert ours.status_code == 200 and ours.json()["data"], ours.text
        assert {row["tenant"] for row in ours.json()["data"]} == {"acme"}
