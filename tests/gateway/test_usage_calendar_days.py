"""A report's day that is no calendar day (`3016-11-31`, `2023-02-29`) is refused by name on both report routes: it
was read as its month's last day, a report of other days than asked, with a 200. The years the pattern takes, 1000
to 9999, read end to end without a fault."""

from __future__ import annotations

from tests.conftest import Gateway

ROUTES = ("/v1/usage", "/admin/usage/report")


def test_a_day_that_does_not_exist_is_refused_and_the_widest_range_is_read(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, gateway.client(gateway.admin_key) as admin:
        for client, path in ((c, ROUTES[0]), (admin, ROUTES[1])):
            for query, param in (({"from": "2026-01-01", "to": "3016-11-31"}, "to"),
                                 ({"from": "2023-02-29"}, "from"), ({"to": "2100-02-29"}, "to")):
                r = client.get(path, params=query)
                assert r.status_code == 400, (path, query, r.text)
                error = r.json()["error"]
                assert (error["param"], error["code"]) == (param, "invalid_value"), (path, query, error)
                assert query[param] in error["message"], error
            for query in ({"from": "1000-01-01", "to": "9999-12-31"}, {"from": "2024-02-29", "to": "2024-02-29"}):
                r = client.get(path, params=query)
                assert r.status_code == 200, (path, query, r.text)
