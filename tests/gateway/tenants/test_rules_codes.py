"""Every refusal of gateway/tenants/rules.py names its field and has a code: `POST /admin/keys {}` (a key with no
tenant that is no admin key) answered 400 with `code: null`, and so did a bad tenant name and a time to live given
with an expiry time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.errors import InvalidRequest
from gateway.tenants.rules import check_new_key, check_tenant_name, new_key_expiry, rotation_spans
from tests.conftest import Gateway

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("call", "param", "code"), [
    (lambda: check_tenant_name("Acme!"), "name", "invalid_value"),
    (lambda: check_new_key(None, "svc", ()), "tenant", "tenant_required"),
    (lambda: check_new_key("acme", "svc", ("admin",)), "tenant", "admin_key_with_tenant"),
    (lambda: check_new_key("acme", "a\nb", ()), "name", "invalid_value"),
    (lambda: new_key_expiry(NOW, 3600, NOW + 3600), "ttl_s", "conflicting_parameters"),
    (lambda: new_key_expiry(NOW, -1, None), "ttl_s", "invalid_duration"),
    (lambda: new_key_expiry(NOW, None, NOW - 1), "expires_at", "invalid_duration"),
    (lambda: rotation_spans(-1, None), "grace_s", "invalid_duration"),
])
def test_every_refusal_names_its_field_and_has_a_code(call: Callable[[], object], param: str, code: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        call()
    assert (exc.value.status_code, exc.value.param, exc.value.code) == (400, param, code)


def test_a_key_asked_for_without_a_tenant_is_refused_with_a_code(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/keys", json={})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "tenant", "tenant_required")
