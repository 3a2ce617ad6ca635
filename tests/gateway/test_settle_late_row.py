"""With the in-process quota store, a request settles its quota in its own task once its ledger row is durable
(gateway/pipeline/settle.py); when the row is not durable within the ledger's wait (a slow disk), the request is
told 503 and its reservation is still settled then, not left held until the row commits or the reaper runs."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_idempotency_ledger_late import MSG, WAIT_S, SlowDisk
from tests.stubs import ServerThread, StubState


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gateway:
        yield gateway


def test_a_row_late_past_the_wait_still_settles_the_quota_at_once(gw: Gateway) -> None:
    quotas = gw.app.state.services.pipeline.settler.quotas
    backend = quotas.backend
    assert isinstance(backend, MemoryBackend) and quotas.settles_at_once  # the path under test
    disk = SlowDisk(gw).arm()
    started = time.monotonic()
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    assert r.status_code == 503, r.text  # the row was not durable in time
    rid = r.headers["x-tiergate-request-id"]
    assert not disk.done.is_set(), "the slow disk let the row through before the check"
    assert rid not in backend._held and rid in backend._done  # settled while its row is still being written
    assert time.monotonic() - started < WAIT_S + 1.0
    assert disk.done.wait(10)
    assert any(row.request_id == rid for row in gw.ledger_rows())  # the row committed late, once


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
    """A stream has sent every token when its row's wait runs out: its last event says so (503's error, then no
    [DONE]), where the connection was broken mid-body; the quota is settled and the row commits late, once."""
    backend = gw.app.state.services.pipeline.settler.quotas.backend
    disk = SlowDisk(gw).arm()
    body = {"model": "mid", "stream": True} | ({"messages": MSG} if "chat" in path else {"prompt": "hello there"})
    with gw.client(gw.tenant_key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200
    last = [line for line in r.text.splitlines() if line.startswith("data:")][-1]
    assert '"code":"ledger_unavailable"' in last, r.text
    rid = r.headers["x-tiergate-request-id"]
    assert rid not in backend._held and rid in backend._done
    assert disk.done.wait(10)
    assert [row.request_id for row in gw.ledger_rows()].count(rid) == 1
