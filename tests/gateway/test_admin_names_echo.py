"""An admin 404 names what was not found in at most 128 characters: a 30 KB tenant name or key id in a path or query
came back whole in the answer (and in every log line that records the error)."""

from __future__ import annotations

from tests.conftest import Gateway

LONG = "x" * 30_000


def test_a_name_not_found_is_cut_in_the_answer(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        for r in (admin.post(f"/admin/keys/{LONG}/revoke"), admin.post(f"/admin/tenants/{LONG}/data-version"),
                  admin.get("/admin/keys", params={"tenant": LONG}),
                  admin.get("/admin/usage/report", params={"tenant": LONG}),
                  admin.post(f"/admin/rollouts/{LONG}/promote", json={"reason": "canary looks good"})):
            assert r.status_code == 404, (r.request.url.path[:40], r.status_code, r.text[:200])
            assert len(r.content) < 2_000 and "x" * 128 in r.json()["error"]["message"], r.request.url.path[:40]
