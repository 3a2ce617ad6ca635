"""A key's budget given through the admin API is stored as the store reads it back. A small budget ("0.0000001", or
the JSON number 1e-7) was written as `1E-7`, which the read refused: from then on that key answered 500, and so did
every listing of keys (GET /admin/keys, whichever tenant it named). A budget longer than 64 digits written out
(1e308, 10**400, 1e-320) was taken too, with the same end; it is refused by name, and no key is issued (as is one
above $9,000,000, quotas/plans.py MAX_BUDGET_USD: tests/gateway/test_limit_maxima.py)."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]


# (budget as given, as listed, the status of a chat request: a ten-millionth of a dollar, or nothing, pays for none)
@pytest.mark.parametrize(("given", "shown", "status"), [
    ("0.0000001", "0.0000001", 429), (1e-7, "0.0000001", 429), (-0.0, "0.0", 429),
    (9e6, "9000000.0", 200), ("12.50", "12.50", 200)])
def test_a_small_or_large_budget_is_kept_as_given_and_the_key_works(gateway: Gateway, given: object, shown: str,
                                                                    status: int) -> None:
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": {"budget_day_usd": given}})
        assert r.status_code == 201, r.text
        key, key_id = r.json()["key"], r.json()["key_id"]
        listed = admin.get("/admin/keys", params={"tenant": "acme"})
        assert listed.status_code == 200, listed.text
        assert {k["key_id"]: k["limits"] for k in listed.json()["data"]}[key_id] == {"budget_day_usd": shown}
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    assert r.status_code == status, r.text
    if status == 429:
        assert r.json()["error"]["code"] == "insufficient_quota"


@pytest.mark.parametrize("given", [1e308, pytest.param(10**400, id="10**400"), 1e-320, "1" + "0" * 64])
def test_a_budget_longer_than_64_digits_is_refused_by_name_and_issues_nothing(gateway: Gateway, given: object) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": {"budget_month_usd": given}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "limits.budget_month_usd"
        after = admin.get("/admin/keys")
        assert after.status_code == 200 and after.json()["data"] == before


def test_the_document_says_an_admin_key_takes_no_limits(gateway: Gateway) -> None:
    """The API refuses an admin key with limits (400 admin_key_with_limits); the OpenAPI document must say so, or a
    client following it (and the suite's fuzzer, which found this) sends a body the document calls valid."""
    import jsonschema

    with gateway.client(gateway.admin_key) as admin:
        document = admin.get("/openapi.json").json()
    schema = document["paths"]["/admin/keys"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    resolver = {"components": document.get("components", {}), **schema}
    body = {"admin": True, "tenant": None, "limits": {"budget_month_usd": "0"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, resolver)
    jsonschema.validate({"admin": True, "tenant": None, "limits": {}}, resolver)  # no limits: valid, as issued
