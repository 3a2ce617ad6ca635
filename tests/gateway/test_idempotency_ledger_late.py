"""An Idempotency-Key never bills twice when the answer's ledger row is late: a row not durable within the ledger's
wait (a slow disk, here its commit held past `record_timeout_s`) fails the request (the client is told 503), but the
row is still queued and commits later, with the stored answer (SQLite, PostgreSQL: in its transaction; Redis: once
it is durable). The claim was given up at once: the row billed the tenant, the answer was not kept, and the client's
retry with the same key ran and was billed again (two rows for one key). Now the claim waits for the row's final
outcome: a retry meanwhile waits (or gets 409), then the replay once the row commits (one row); a row refused for good
gives the claim up, so the retry runs (one row in all). Chat and embeddings alike, on every store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState

MSG = [{"role": "user", "content": "hello there"}]
MODEL = "all-MiniLM-L6-v2"
REPLAY = "x-tiergate-idempotent-replay"
LATE_S = 1.5  # how long the slow disk holds the row's commit
WAIT_S = 0.3  # the ledger's wait for a row (record_timeout_s), shorter than that


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def gw(request: pytest.FixtureRequest, gateway_settings: Settings,
       stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    """A gateway with the idempotency records in SQLite, PostgreSQL (each with the ledger) or Redis."""
    if request.param == "postgres":
        gateway_settings = gateway_settings.model_copy(
            update={"database_url": request.getfixturevalue("database_url")})
    elif request.param == "redis":
        gateway_settings = gateway_settings.model_copy(update={"redis_url": request.getfixturevalue("redis_url")})
    with running_gateway(gateway_settings, stub[1]) as gateway:
        yield gateway


class SlowDisk:
    """The gateway's ledger with its next commit of rows held `late_s` (a slow disk), then committed, or refused
    (`fail`: nothing committed, each row's future failed, as for a row the database refuses)."""

    def __init__(self, gw: Gateway, *, late_s: float = LATE_S, fail: bool = False) -> None:
        self.ledger = gw.app.state.services.pipeline.settler.ledger
        self.ledger.record_timeout_s = WAIT_S
        self.late_s, self.fail = late_s, fail
        self.armed = threading.Event()
        self.done = threading.Event()
        real = self.ledger._commit

        def commit(conn: Any, rows: list[Any], counts: Any, **kwargs: Any) -> list[Exception | None]:
            if rows and self.armed.is_set():
                self.armed.clear()
                time.sleep(self.late_s)
                try:
                    if self.fail:
                        return [RuntimeError("the test's disk refused the row")] * len(rows)
                    return real(conn, rows, counts, **kwargs)
                finally:
                    self.done.set()
            return real(conn, rows, counts, **kwargs)

        self.ledger._commit = commit

    def arm(self) -> SlowDisk:
        self.done.clear()
        self.armed.set()
        return self


def chat(gw: Gateway, key: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}, headers={"idempotency-key": key})


def embed(gw: Gateway, key: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/embeddings", json={"model": MODEL, "input": ["How do I reset my password?"]},
                      headers={"idempotency-key": key})


WARM_UP: set[str] = set()  # the warm-ups' request ids, left out of the rows counted


def warm_embeddings(gw: Gateway) -> None:
    with gw.client(gw.tenant_key) as c:  # builds the service and loads the model
        r = c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"})
        assert r.status_code == 200, r.text
        WARM_UP.add(r.headers["x-tiergate-request-id"])


def rows_of(gw: Gateway, tier: str) -> list[Any]:
    """The route's rows, the embeddings warm-up's left out."""
    return [r for r in gw.ledger_rows() if r.tier == tier and r.request_id not in WARM_UP]


def wait_until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


ROUTES = {"chat": (chat, "mid"), "embeddings": (embed, "embeddings")}



@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_late_row_that_commits_is_replayed_to_the_retry_and_billed_once(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    disk = SlowDisk(gw).arm()
    r = send(gw, "order-1")
    assert r.status_code == 503, r.text  # the row was not durable in time: the client is told so
    assert disk.done.wait(10)  # the row committed late, with its answer (SQL) or before it is kept (Redis)
    wait_until(lambda: len(rows_of(gw, tier)) == 1)
    again = send(gw, "order-1")  # the client's retry with the same key
    assert again.status_code == 200, again.text
    rows = rows_of(gw, tier)
    assert len(rows) == 1, f"billed {len(rows)} times for one key: {[(r.status, r.price_usd) for r in rows]}"
    assert again.headers.get(REPLAY) == "true"  # the answer the tenant was billed for, not a second run
    if route == "chat":
        assert len(gw.stub.requests) == 1


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_retry_while_the_late_row_is_pending_waits_for_it_and_is_replayed(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    disk = SlowDisk(gw).arm()
    assert send(gw, "order-2").status_code == 503
    assert not disk.done.is_set()  # the row is still on its way
    again = send(gw, "order-2")  # waits while the claim is the late row's, then replays its answer
    assert again.status_code == 200, again.text
    rows = rows_of(gw, tier)
    assert len(rows) == 1, f"billed {len(rows)} times for one key: {[(r.status, r.price_usd) for r in rows]}"
    assert again.headers.get(REPLAY) == "true"


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_late_row_refused_for_good_gives_the_claim_up_and_the_retry_runs_once(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    disk = SlowDisk(gw, fail=True).arm()
    assert send(gw, "order-3").status_code == 503
    assert disk.done.wait(10)
    again = send(gw, "order-3")  # the row never was: the claim is given up, and the retry runs (a wait at most)
    assert again.status_code == 200, again.text
    assert again.headers.get(REPLAY) is None
    assert len(rows_of(gw, tier)) == 1  # the retry's own: one row in all
    if route == "chat":
        assert len(gw.stub.requests) == 2
