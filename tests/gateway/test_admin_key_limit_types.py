"""A key's request and token limits are JSON integers: `true`, "5" or 5.5 given through the admin API is refused by
name, and no key is issued (5.0 is the integer 5, as JSON Schema's `integer` says). The body is strict (`ttl_s: "5"`
was refused) but its `limits` were not: `rpm: true` made a key limited to one request a minute, and `tpm: "100"` was
read as 100."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway


@pytest.mark.parametrize(("field", "given"), [("rpm", True), ("rpm", "5"), ("tpm", "100"), ("tpm", 5.5),
                                              ("max_concurrent", False), ("max_concurrent", "2")])
def test_a_limit_that_is_not_an_integer_is_refused_and_issues_nothing(gateway: Gateway, field: str,
                                                                      given: object) -> None:
    with gateway.client(gateway.admin_key) as admin:
        before = admin.get("/admin/keys").json()["data"]
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": {field: given}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"limits.{field}"
        assert admin.get("/admin/keys").json()["data"] == before


def test_integer_limits_are_still_taken(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": {"rpm": 5, "tpm": 0, "max_concurrent": 2.0}})
    assert r.status_code == 201 and r.json()["limits"] == {"rpm": 5, "tpm": 0, "max_concurrent": 2}
