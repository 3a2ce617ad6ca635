"""The admin POST routes that take no body refuse one with fields by name, and change nothing: a body was dropped
and the change made as if it had not been sent (`{"path": …}` to /admin/degrade/reload reloaded the configured file,
a 200). No body, or `{}`, is still the request."""

from __future__ import annotations

from typing import Any

from tests.conftest import Gateway


def _refused(r: Any, param: str | None, code: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


def test_a_body_with_fields_is_refused_by_name_and_changes_nothing(gateway: Gateway) -> None:
    key, _ = gateway.store.issue_key("acme", name="to-revoke")
    with gateway.client(gateway.admin_key) as admin:
        history = admin.get("/admin/degrade/history").json()["data"]
        _refused(admin.post("/admin/degrade/reload", json={"path": "/etc/other-ladder.yaml"}), "path",
                 "unsupported_parameter")
        _refused(admin.post("/admin/degrade/auto", json={"reason": "incident 42"}), "reason", "unsupported_parameter")
        _refused(admin.post("/admin/tenants/acme/data-version", json={"data_version": "report-7"}), "data_version",
                 "unsupported_parameter")
        _refused(admin.post(f"/admin/keys/{key.key_id}/revoke", json={"grace_s": 3600}), "grace_s",
                 "unsupported_parameter")
        _refused(admin.post("/admin/degrade/auto", content=b"[1]"), None, "invalid_json")
        _refused(admin.post("/admin/degrade/auto", content=b"{"), None, "invalid_json")
        # nothing changed: no ladder event, the key still live, and the next bump is the first
        assert admin.get("/admin/degrade/history").json()["data"] == history
        keys = {k["key_id"]: k for k in admin.get("/admin/keys", params={"tenant": "acme"}).json()["data"]}
        assert keys[key.key_id]["revoked_at"] is None

        # no body, or `{}`, is the request
        assert admin.post("/admin/tenants/acme/data-version", json={}).json()["data_version"] == 1
        assert admin.post("/admin/tenants/acme/data-version").json()["data_version"] == 2
        assert admin.post("/admin/degrade/auto").status_code == 200
        assert admin.post("/admin/degrade/auto", json={}).status_code == 200
        assert admin.post("/admin/degrade/reload", content=b" {} ").status_code == 200
        assert admin.post(f"/admin/keys/{key.key_id}/revoke", json={}).json()["revoked_at"] is not None
