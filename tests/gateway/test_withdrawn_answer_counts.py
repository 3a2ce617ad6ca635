"""A JSON answer whose ledger row was withdrawn (queued past the ledger's wait: gateway/pipeline/settle.py) reached its
client as a 503 `ledger_unavailable`, billed nothing. Everything that counts the request counts that 503, not the
answer it never got: `tiergate_requests_total` (status `error`), the degradation ladder's 5xx signal, and the cache,
which never keeps the withheld answer (a repeat is answered afresh, not from the cache). Before, the answer was
counted `ok`, a 200 to the ladder, and kept in the cache, all before its row's wait ended. Chat, text completions
and embeddings."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cache_api import ask
from tests.gateway.test_idempotency_ledger_late import ROUTES, StuckWriter, warm_embeddings
from tests.stubs import ServerThread, StubState


def complete(gw: Gateway, key: str) -> httpx.Response:
    """A legacy text completion (the chat pipeline's path, framed as /v1/completions)."""
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/completions", json={"model": "mid", "prompt": "hello there"},
                      headers={"idempotency-key": key})


SENDERS = ROUTES | {"completions": (complete, "mid")}
_REQUESTS = re.compile(r'^tiergate_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gateway:
        yield gateway


def requests_by_status(gw: Gateway, tier: str) -> Counter[str]:
    """`tiergate_requests_total` of the tenant on `tier`, by status, as /metrics exports it."""
    with gw.client(gw.admin_key) as admin:
        text = admin.get("/metrics").text
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if (m := _REQUESTS.match(line)) is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels["tenant"] == "acme" and labels["tier"] == tier:
            counts[labels["status"]] += int(float(m["value"]))
    return counts


@pytest.mark.parametrize("route", ["chat", "completions", "embeddings"])
def test_a_withdrawn_answer_counts_as_the_503_its_client_got(gw: Gateway, route: str) -> None:
    send, tier = SENDERS[route]
    if route == "embeddings":
        warm_embeddings(gw)
    before = requests_by_status(gw, tier)
    with StuckWriter(gw):
        r = send(gw, f"counted-{route}")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "ledger_unavailable"
    after = requests_by_status(gw, tier)
    assert after - before == Counter({"error": 1}), f"counted {dict(after - before)} for the client's 503"
    ok = send(gw, f"counted-{route}-again")  # a row written in time: its answer is counted ok, as before
    assert ok.status_code == 200, ok.text
    assert requests_by_status(gw, tier) - after == Counter({"ok": 1})


def test_a_withdrawn_answer_is_a_5xx_to_the_ladder(gw: Gateway) -> None:
    signals = gw.app.state.services.pipeline.settler.signals
    assert signals.read()["error_rate"] == 0.0
    with StuckWriter(gw):
        r = ROUTES["chat"][0](gw, "ladder")
        assert r.status_code == 503, r.text
    assert signals.read()["error_rate"] == 1.0, "the ladder heard a 200 where the client got a 503"


def test_a_withdrawn_answer_is_never_kept_in_the_cache(gw: Gateway) -> None:
    with StuckWriter(gw):
        first = ask(gw)
        assert first.status_code == 503, first.text
    repeat = ask(gw)  # the first answer was never the client's: the repeat runs on the tier
    assert repeat.status_code == 200, repeat.text
    assert repeat.headers["x-tiergate-cache"] == "miss", "the cache kept an answer its client never got"
    assert len(gw.stub.requests) == 2
    third = ask(gw)  # an answer its client got is kept, as before
    assert third.headers["x-tiergate-cache"] == "hit" and len(gw.stub.requests) == 2
