"""An admin change keeps no answer under an Idempotency-Key, so the header is refused by name on every admin route
that changes something (gateway/auth.py `require_admin`), never dropped: `POST /admin/keys` sent twice with the same
key issued two live keys, and a client retrying a lost answer left a credential nobody saw."""

from __future__ import annotations

import httpx

from tests.conftest import Gateway
from tests.gateway.test_route_guard_table import ADMIN_ROUTES, BODIES, _path, _state

CHANGES = [(method, path) for method, path in ADMIN_ROUTES if method not in ("GET", "HEAD", "OPTIONS")]


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        "Idempotency-Key", "unsupported_parameter", "invalid_request_error"), error


def test_a_key_issued_twice_under_one_idempotency_key_is_refused_and_none_is_issued(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        keys = admin.get("/admin/keys").json()["data"]
        for _ in range(2):
            _refused(admin.post("/admin/keys", json={"tenant": "acme", "name": "x1"},
                                headers={"Idempotency-Key": "adm1"}))
        assert admin.get("/admin/keys").json()["data"] == keys
        # a read changes nothing: the header is moot there, and it is answered
        r = admin.get("/admin/keys", headers={"Idempotency-Key": "adm1"})
        assert r.status_code == 200 and r.json()["data"] == keys
    with gateway.client(gateway.tenant_key) as tenant:  # the key's check comes first: a tenant learns nothing more
        r = tenant.post("/admin/keys", json={"tenant": "acme", "name": "x1"}, headers={"Idempotency-Key": "adm1"})
        assert r.status_code == 403, r.text


def test_every_admin_change_refuses_an_idempotency_key_and_changes_nothing(gateway: Gateway) -> None:
    assert len(CHANGES) >= 10  # tenants, data versions, keys, degrade, rollouts
    before = _state(gateway)
    with gateway.client(gateway.admin_key) as admin:
        for method, template in CHANGES:
            r = admin.request(method, _path(template, gateway), json=BODIES.get(template.rstrip("/"), {}),
                              headers={"Idempotency-Key": "adm2"})
            assert r.status_code == 400, (method, template, r.text)
            _refused(r)
    assert _state(gateway) == before
