"""Cache-Control through the HTTP API: `no-cache`, `no-store` and `max-age=0` (as `no-cache`) are honoured, in any
case and with spaces; any other directive is refused by name (400 `invalid_header`, param `cache-control`) before
anything is spent: no tier call, no ledger row, no cache lookup or write. Every other directive was dropped:
`max-age=0` and a misspelt `no-cahce` on a repeat were served the stored answer, and `only-if-cached` on a new
question went to the tier and was billed."""

from __future__ import annotations

import importlib

import httpx
import pytest

from cache.request_key import parse_cache_control
from tests.conftest import Gateway
from tests.gateway.test_cache_api import Q, ask, upstream_calls


def entries(gw: Gateway) -> int:
    return len(gw.app.state.services.cache.cache.entries)


def lookups(gw: Gateway) -> tuple[int, ...]:
    """The cache's counts of requests looked up or bypassed, and of answers stored."""
    s = gw.app.state.services.cache.cache.stats
    return s.exact_hits, s.semantic_hits, s.misses, s.bypasses, s.stored


def refused(r: httpx.Response, shown: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_header", error
    assert error["param"] == "cache-control" and shown in error["message"], error


REFUSED = [
    ("no-cahce", "'no-cahce'"),  # misspelt: it was dropped, and the repeat a hit
    ("only-if-cached", "'only-if-cached'"),
    ("max-age=60", "'max-age=60'"),
    ("max-age=", "'max-age='"),  # an empty argument
    ("no-cache=\"x\"", "'no-cache=\"x\"'"),  # a request's no-cache takes none
    ("No-Store, max-stale", "'max-stale'"),  # one honoured directive does not carry a refused one
    ("%%garbage%%", "'%%garbage%%'"),
    ("no-cache" + "," * 40, "more than 8"),  # many commas
    ("no-cache, " + "x" * 300, "at most 256"),
]


@pytest.mark.parametrize(("value", "shown"), REFUSED)
def test_a_directive_not_honoured_is_refused_by_name_and_changes_nothing(gateway: Gateway, value: str,
                                                                          shown: str) -> None:
    first = ask(gateway)  # stored: a repeat would be a hit
    assert first.headers["x-tiergate-cache"] == "miss"
    before = (upstream_calls(gateway), len(gateway.ledger_rows()), entries(gateway), lookups(gateway))
    refused(ask(gateway, headers={"cache-control": value}), shown)  # the repeat: not served from the cache
    refused(ask(gateway, "A question never asked.", headers={"cache-control": value}), shown)  # a new one
    assert (upstream_calls(gateway), len(gateway.ledger_rows()), entries(gateway), lookups(gateway)) == before
    assert ask(gateway, "A question never asked.").headers["x-tiergate-cache"] == "miss"  # it was not stored


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/embeddings"])
def test_every_model_route_refuses_it(gateway: Gateway, route: str) -> None:
    body = {"model": "all-MiniLM-L6-v2", "input": Q} if route == "/v1/embeddings" else {
        "model": "mid", "prompt": Q, "temperature": 0}
    with gateway.client(gateway.tenant_key) as c:
        refused(c.post(route, json=body, headers={"cache-control": "only-if-cached"}), "'only-if-cached'")
    assert not gateway.stub.requests and not gateway.ledger_rows()


def test_max_age_zero_is_no_cache(gateway: Gateway) -> None:
    ask(gateway)
    for value in ("max-age=0", "MAX-AGE=0", "max-age=\"0\""):  # a browser's reload: no stored answer is served
        r = ask(gateway, headers={"cache-control": value})
        assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "bypass", r.text
    assert upstream_calls(gateway) == 4 and ask(gateway).headers["x-tiergate-cache"] == "hit"


def test_no_cache_and_no_store_in_any_case_and_spacing(gateway: Gateway) -> None:
    assert ask(gateway, headers={"cache-control": "No-Store"}).headers["x-tiergate-cache"] == "miss"
    assert ask(gateway).headers["x-tiergate-cache"] == "miss"  # the no-store answer was not kept; this one is
    assert ask(gateway, headers={"cache-control": "NO-CACHE"}).headers["x-tiergate-cache"] == "bypass"
    assert ask(gateway, headers={"cache-control": "no-cache ,\tNO-STORE"}).headers["x-tiergate-cache"] == "bypass"
    assert ask(gateway, headers={"cache-control": ", no-store,"}).headers["x-tiergate-cache"] == "hit"  # empty ones
    assert ask(gateway, headers={"cache-control": ""}).headers["x-tiergate-cache"] == "hit"  # no directive at all
    assert upstream_calls(gateway) == 4 and len(gateway.ledger_rows()) == 6


def test_the_header_is_read_once_a_request(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directives read at the door (gateway/request_headers.py) are the ones the cache's lookup and store use,
    handed on with the headers: the value was parsed there, again for the lookup and again for the store."""
    read: list[str] = []

    def counted(value: str) -> frozenset[str]:
        read.append(value)
        return parse_cache_control(value)

    for module in ("gateway.request_headers", "cache.request_key"):  # `cache` exports a function named request_key
        monkeypatch.setattr(importlib.import_module(module), "parse_cache_control", counted)
    r = ask(gateway, "Asked once, not kept.", headers={"cache-control": "no-store"})  # looked up, then not stored
    assert r.status_code == 200 and r.headers["x-tiergate-cache"] == "miss", r.text
    assert ask(gateway, "Asked once, not kept.").headers["x-tiergate-cache"] == "miss"  # the no-store was honoured
    assert read == ["no-store"]
