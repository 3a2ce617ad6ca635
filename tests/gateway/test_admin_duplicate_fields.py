"""A field given twice in one object of an admin change's body is a 400 naming it, and changes nothing. JSON keeps
the last of the two: `{"name": "a", "name": "b"}` made tenant b, its first name dropped unread (a field we do not
read is refused by name, never dropped)."""

from __future__ import annotations

import httpx

from tests.conftest import Gateway


def twice(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "duplicate_field"), error


def test_a_field_given_twice_is_refused_by_name_and_nothing_changes(gateway: Gateway) -> None:
    json_type = {"content-type": "application/json"}
    with gateway.client(gateway.admin_key) as admin:
        tenants = admin.get("/admin/tenants").json()["data"]
        keys = admin.get("/admin/keys").json()["data"]
        level = admin.get("/admin/degrade/").json()["level"]
        twice(admin.post("/admin/tenants", content=b'{"name": "dup1", "name": "dup2"}', headers=json_type), "name")
        twice(admin.post("/admin/keys", content=b'{"tenant": "acme", "limits": {"rpm": 5, "rpm": 500}}',
                         headers=json_type), "rpm")
        twice(admin.post("/admin/degrade/", content=b'{"level": 0, "reason": "drill", "level": 2}',
                         headers=json_type), "level")
        assert admin.get("/admin/tenants").json()["data"] == tenants
        assert admin.get("/admin/keys").json()["data"] == keys
        assert admin.get("/admin/degrade/").json()["level"] == level
        # the same bodies, each field once, are taken
        assert admin.post("/admin/tenants", json={"name": "dup2"}).status_code == 201
        assert admin.post("/admin/keys", json={"tenant": "acme", "limits": {"rpm": 500}}).status_code == 201
