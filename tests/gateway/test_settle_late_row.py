"""With the in-process quota store, a request settles its quota in its own task once its ledger row's fate is known
(gateway/pipeline/settle.py). A JSON answer's row not durable within the ledger's wait (a slow disk) and still
queued is withdrawn: the client is told 503 and nothing is spent, the reservation given back at once (not settled at
the answer's price, nor held until the store catches up), and no row commits later. Its row's own commit under way,
the request waits for that commit and is answered (and billed) as it decides. Before, the client was told 503 at
once and the reservation settled at the answer's price, and the row committed once the store caught up: billed for
an answer it never received."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.errors import USAGE_LATE_MESSAGE
from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_idempotency_ledger_late import (
    MSG,
    ROUTES,
    WAIT_S,
    SlowDisk,
    StuckWriter,
    rows_of,
    wait_until,
    warm_embeddings,
)
from tests.stubs import ServerThread, StubState


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gateway:
        yield gateway


def spent_pico(backend: MemoryBackend) -> int:
    """Money the quota store has charged today, all scopes (the test's one tenant)."""
    return sum(sum(st.spent_day.values()) for st in backend._state.values())


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_row_queued_past_the_wait_is_withdrawn_and_nothing_is_spent(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    quotas = gw.app.state.services.pipeline.settler.quotas
    backend = quotas.backend
    assert isinstance(backend, MemoryBackend) and quotas.settles_at_once  # the path under test
    before = spent_pico(backend)
    started = time.monotonic()
    with StuckWriter(gw):
        r = send(gw, "order-w1")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "ledger_unavailable"
        assert time.monotonic() - started < WAIT_S + 1.0
        rid = r.headers["x-tiergate-request-id"]
        wait_until(lambda: rid in backend._done)  # given back while the store is still slow
        assert rid not in backend._held
        assert spent_pico(backend) == before, "the quota charged for an answer the client never received"
    again = send(gw, "order-w1")  # after the store caught up: the first row is not among those it wrote
    assert again.status_code == 200, again.text
    rows = rows_of(gw, tier)
    assert [row.request_id for row in rows] == [again.headers["x-tiergate-request-id"]], \
        f"billed {len(rows)} times: {[(row.status, row.price_usd) for row in rows]}"
    assert spent_pico(backend) - before == int(rows[0].price_usd * 10**12)  # the retry's, once


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_row_whose_commit_is_under_way_past_the_wait_is_answered_and_billed_as_it_commits(
        gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    backend = gw.app.state.services.pipeline.settler.quotas.backend
    before = spent_pico(backend)
    disk = SlowDisk(gw).arm()  # the row's own commit, held past the wait, then committed
    r = send(gw, "order-w2")
    assert disk.done.is_set()
    assert r.status_code == 200, r.text  # the client gets the answer it is billed for
    rid = r.headers["x-tiergate-request-id"]
    [row] = rows_of(gw, tier)
    assert row.request_id == rid
    assert rid not in backend._held and spent_pico(backend) - before == int(row.price_usd * 10**12)


def test_a_client_that_leaves_while_its_row_is_written_hands_the_settle_off(gw: Gateway) -> None:
    """The branch where the request's task is cancelled during the row's wait: its client left. The quota is not
    settled before the row is durable (a settled quota never lacks its row) and is settled once it is, by the
    handed-off settle, not left held until the reaper returns it."""
    quotas = gw.app.state.services.pipeline.settler.quotas
    backend = quotas.backend
    assert isinstance(backend, MemoryBackend) and quotas.settles_at_once  # the path under test
    disk = SlowDisk(gw).arm()
    disk.ledger.record_timeout_s = 10.0  # the request waits for its row longer than its client does
    with gw.client(gw.tenant_key) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.monotonic() + 5
    while not backend._held and time.monotonic() < deadline:
        time.sleep(0.01)
    [rid] = backend._held  # reserved, answered, its row held by the slow disk
    assert not disk.done.is_set() and rid not in backend._done  # not settled before its row is durable
    assert disk.done.wait(10)
    while rid in backend._held and time.monotonic() < deadline + 10:
        time.sleep(0.01)
    assert rid not in backend._held and rid in backend._done  # settled once the row was, by the handed-off settle
    assert [row.request_id for row in gw.ledger_rows()].count(rid) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_whose_row_is_late_ends_with_the_error_event_and_settles(gw: Gateway, path: str) -> None:
    """A stream has sent every token when its row's wait runs out: its last event says so (an error event, then no
    [DONE]), where the connection was broken mid-body; the quota is settled and the row commits late, once. The event
    tells the truth: the answer is complete and billed, do not retry (it said "cannot record usage now; retry later",
    the JSON 503's words, and a client that retried without an Idempotency-Key was billed twice)."""
    backend = gw.app.state.services.pipeline.settler.quotas.backend
    disk = SlowDisk(gw).arm()
    body = {"model": "mid", "stream": True} | ({"messages": MSG} if "chat" in path else {"prompt": "hello there"})
    with gw.client(gw.tenant_key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200
    last = [line for line in r.text.splitlines() if line.startswith("data:")][-1]
    error = json.loads(last.removeprefix("data:"))["error"]
    assert error == {"message": USAGE_LATE_MESSAGE, "type": "api_error", "param": None,
                     "code": "usage_recorded_late"}, error
    assert "do not retry" in error["message"] and "retry later" not in error["message"]
    rid = r.headers["x-tiergate-request-id"]
    assert rid not in backend._held and rid in backend._done
    assert disk.done.wait(10)
    assert [row.request_id for row in gw.ledger_rows()].count(rid) == 1


def billed_metrics(gw: Gateway) -> dict[str, float]:
    """The tenant's spend and token counters as /metrics exports them (every tier summed)."""
    with gw.client(gw.admin_key) as admin:
        text = admin.get("/metrics").text
    sums = {"tiergate_price_usd_total": 0.0, "tiergate_tokens_total": 0.0, "tiergate_compute_cost_usd_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in sums and 'tenant="acme"' in line:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_withdrawn_row_is_not_in_the_spend_metrics(gw: Gateway, route: str) -> None:
    """The tenant's price, token and compute-cost counters follow the ledger: a JSON answer whose row was withdrawn
    (its client got 503, nothing billed) adds nothing to them, a row written adds its own. They counted the
    withdrawn answer's price and tokens, before its row's wait: overstating what the ledger holds."""
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    before = billed_metrics(gw)
    with StuckWriter(gw):
        r = send(gw, f"metrics-{route}-1")
        assert r.status_code == 503, r.text
    assert billed_metrics(gw) == before, "the metrics billed an answer whose row was withdrawn"
    ok = send(gw, f"metrics-{route}-2")
    assert ok.status_code == 200, ok.text
    [row] = rows_of(gw, tier)
    after = billed_metrics(gw)
    assert after["tiergate_price_usd_total"] - before["tiergate_price_usd_total"] == pytest.approx(
        float(row.price_usd))
    assert after["tiergate_tokens_total"] - before["tiergate_tokens_total"] == row.input_tokens + row.output_tokens
