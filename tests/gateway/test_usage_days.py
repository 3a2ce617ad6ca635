"""The reports' days: `from` is in the published document of both report routes, as `to` is (it was read from the
query by hand and published nowhere), and an empty day is refused by name: `?from=` answered the whole history, as
if no bound had been sent. A day that is not one is refused in words on both, never with Litestar's regex."""

from __future__ import annotations

from tests.conftest import Gateway

ROUTES = ("/v1/usage", "/admin/usage/report")


def test_both_days_are_published_refused_by_name_when_empty_and_read_when_sent(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, gateway.client(gateway.admin_key) as admin:
        doc = c.get("/openapi.json").json()
        for path in ROUTES:
            params = {p["name"]: p for p in doc["paths"][path]["get"]["parameters"]}
            for day in ("from", "to"):
                assert params[day]["in"] == "query" and params[day]["schema"]["pattern"].startswith("^("), (path, day)

        for client, path in ((c, ROUTES[0]), (admin, ROUTES[1])):
            for query, param in ((b"from=", "from"), (b"to=", "to"), (b"from=&to=2026-12-06", "from"),
                                 (b"to=0001-01-01", "to"), (b"from=0001-01-01", "from")):
                r = client.get(path + "?" + query.decode())
                assert r.status_code == 400, (path, query, r.text)
                error = r.json()["error"]
                assert (error["param"], error["code"]) == (param, "invalid_value"), (path, query, error)
                assert "is not a date like 2026-11-30" in error["message"], error  # words, not a regex

            one_day = client.get(path, params={"from": "2026-12-06", "to": "2026-12-06"})
            assert one_day.status_code == 200, one_day.text
            reversed_days = client.get(path, params={"from": "2026-12-07", "to": "2026-12-06"})
            assert reversed_days.json()["error"]["param"] == "from", reversed_days.text
            assert client.get(path, params={"from": "2026-12-06"}).status_code == 200

