"""GET /admin/rollouts/history?tier=: a name that is no tier (and has no trail) is a 404 naming it, as a misspelt
tenant is on /admin/keys and the usage report; it answered an empty trail, which reads as a tier never rolled out.
A tier of the tiers file with no rollouts is an empty trail."""

from __future__ import annotations

from tests.conftest import Gateway


def test_a_misspelt_tier_is_a_404_not_an_empty_trail(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        for tier in ("Mid", "mid ", "m" * 5000):
            r = admin.get("/admin/rollouts/history", params={"tier": tier})
            assert r.status_code == 404, (tier[:10], r.text)
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("tier", "tier_not_found"), error
            assert len(error["message"]) < 300  # the name is not echoed whole
        r = admin.get("/admin/rollouts/history", params={"tier": "mid"})
        assert (r.status_code, r.json()) == (200, {"data": []})
        assert admin.get("/admin/rollouts/history").json() == {"data": []}
