"""An integer query parameter (`limit` of the admin histories) takes an integer's digits only: msgspec, which
Litestar reads it with, took a float's text whose value is whole, so `?limit=1e3` answered a thousand events and
`?limit=1.0` one, with a 200. Each of these is refused by name, and a plain integer is still read."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.query_params import integer_names, refuse_non_integers
from gateway.routes.degrade import history as degrade_history
from gateway.routes.rollouts import history as rollout_history
from tests.conftest import Gateway

NOT_INTEGERS = ["1e3", "1E3", "1.0", "1000.0", "1e-0", "+5", " 5", "5 ", "0x10", "0o7", "1_000", "05", "٥", "５",
                "1\n", "", "--5", "5-"]
HISTORIES = ("/admin/degrade/history", "/admin/rollouts/history")


def test_what_is_no_integers_digits_is_refused_by_name_on_every_history(gateway: Gateway) -> None:
    with gateway.client(gateway.admin_key) as admin:
        for path in HISTORIES:
            for value in NOT_INTEGERS:
                r = admin.get(path, params={"limit": value})
                assert r.status_code == 400, (path, value, r.text)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, r.text
                assert (error["param"], error["code"]) == ("limit", "invalid_value"), (path, value, r.text)
                assert error["message"].startswith("limit"), r.text
            for value in ("1", "100", "1000"):
                assert admin.get(path, params={"limit": value}).status_code == 200, (path, value)
            for value in ("0", "-5", "-0", "1001", "9" * 40):  # digits, out of the route's bounds: still refused
                r = admin.get(path, params={"limit": value})
                assert r.status_code == 400 and r.json()["error"]["param"] == "limit", (path, value, r.text)


def test_the_integer_parameters_are_read_from_the_routes_signature() -> None:
    assert integer_names(degrade_history) == integer_names(rollout_history) == frozenset({"limit"})


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_refuse_non_integers_names_the_parameter(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        refuse_non_integers([("tier", "1e3"), ("limit", value)], frozenset({"limit"}))
    assert (caught.value.param, caught.value.code) == ("limit", "invalid_value")
    refuse_non_integers([("tier", "1e3"), ("limit", "12"), ("limit", "-3")], frozenset({"limit"}))  # digits pass
