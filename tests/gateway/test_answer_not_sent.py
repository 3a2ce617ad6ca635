"""A JSON answer the gateway fails to build once the tier has answered (a bug of ours in the route's framing of the
events, or in its serialisation) reaches its client as a 500 in OpenAI's shape, and the client is billed nothing for
it, as for a JSON answer whose ledger row was withdrawn (gateway/pipeline/settle.py): its ledger row bills nothing,
the quota spends nothing, the metrics count the 500, the cache does not keep the answer, and an Idempotency-Key is
not left replaying an answer its client never got (the client's retry with the key runs). Before, the attempt had
settled `ok` before the body was built: billed for the answer, counted ok, cached and stored for replay, while its
client was told 500. Chat and text completions.

A copy of a settled answer made off its path once it is settled (a sample of cache hits checked against the tier, a
rollout's shadow) that fails is logged, never the client's error: the answer is billed already. Before, the client
got a 500 for an answer it was billed for."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cache_api import wait_for_stores
from tests.gateway.test_idempotency_ledger_late import wait_until
from tests.gateway.test_settle_late_row import spent_pico
from tests.gateway.test_withdrawn_answer_counts import requests_by_status
from tests.stubs import ServerThread, StubState
from wire import responses

REPLAY = "x-tiergate-idempotent-replay"


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gateway:
        yield gateway


def chat(gw: Gateway, key: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", headers={"idempotency-key": key},
                   json={"model": "mid", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0})
    wait_for_stores(gw)
    return r


def complete(gw: Gateway, key: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/completions", headers={"idempotency-key": key},
                   json={"model": "mid", "prompt": "hello there", "temperature": 0})
    wait_for_stores(gw)
    return r


# each route, and the builder of its JSON answer its `_whole` calls once the events have ended
ROUTES: dict[str, tuple[Callable[[Gateway, str], httpx.Response], str]] = {
    "chat": (chat, "completion"), "completions": (complete, "text_completion")}


class Bug(RuntimeError):
    """The test's fault in building the answer (its text must never reach the client)."""


def failing_once(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """`wire.responses.<name>` raising on its next call, then as it was; the calls that raised, counted."""
    real, raised = getattr(responses, name), []

    def build(**kwargs: Any) -> dict[str, Any]:
        if not raised:
            raised.append(1)
            raise Bug("secret detail of the broken builder")
        return real(**kwargs)

    monkeypatch.setattr(responses, name, build)
    return raised


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_answer_that_fails_to_build_is_a_500_billed_nothing(gw: Gateway, monkeypatch: pytest.MonkeyPatch,
                                                              route: str) -> None:
    send, builder = ROUTES[route]
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    spent, counted = spent_pico(backend), requests_by_status(gw, "mid")
    raised = failing_once(monkeypatch, builder)
    r = send(gw, f"unsent-{route}")
    assert raised == [1], "the answer was never built"
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "internal_error", error
    assert "secret" not in r.text
    rid = r.headers["x-tiergate-request-id"]
    wait_until(lambda: not backend._held)  # the reservation settled
    rows = [(row.status, row.http_status, row.error_code, row.price_usd) for row in gw.ledger_rows()
            if row.request_id == rid]
    assert rows == [("error", 500, "internal_error", 0)], f"billed for an answer its client never got: {rows}"
    assert spent_pico(backend) == spent, "the quota charged for an answer its client never got"
    assert requests_by_status(gw, "mid") - counted == Counter({"error": 1}), "not counted as the 500 it was"
    again = send(gw, f"unsent-{route}")  # the retry with the key runs: nothing of the first was kept or cached
    assert again.status_code == 200, again.text
    assert again.headers.get(REPLAY) is None, "replayed an answer its client never got"
    assert again.headers["x-tiergate-cache"] == "miss", "the cache kept an answer its client never got"
    assert len(gw.stub.requests) == 2
    rows = [row for row in gw.ledger_rows() if row.price_usd]
    assert [row.request_id for row in rows] == [again.headers["x-tiergate-request-id"]]
    assert spent_pico(backend) - spent == int(rows[0].price_usd * 10**12)  # the retry's, once


def test_a_copy_off_the_path_that_fails_leaves_the_answer_its_client_is_billed_for(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    checks, sent = gw.app.state.services.pipeline.cache_checks, []  # the sampler of cache hits to check, failing

    def send(*args: Any, **kw: Any) -> None:
        sent.append(1)
        raise Bug("secret detail of the broken sampler")

    assert checks is not None
    monkeypatch.setattr(checks, "send", send)
    first = chat(gw, "copied-1")
    assert first.status_code == 200, first.text
    hit = chat(gw, "copied-2")  # the same question: a cache hit, which the sampler is asked to copy
    assert sent == [1]
    assert hit.status_code == 200, hit.text
    assert hit.headers["x-tiergate-cache"] == "hit"
    assert hit.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    row = next(row for row in gw.ledger_rows() if row.request_id == hit.headers["x-tiergate-request-id"])
    assert (row.status, row.http_status) == ("ok", 200)
