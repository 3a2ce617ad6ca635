"""An Idempotency-Key never bills twice, and its stored answer agrees with what the client was told, when the
answer's ledger row is late (not durable within the ledger's wait, `record_timeout_s`), on every store (SQLite,
PostgreSQL: the answer commits in the row's transaction; Redis: stored once the row commits):

- the row still queued behind a slow commit is withdrawn (gateway/pipeline/settle.py): the client is told 503, no
  row and no answer commit, the claim is given up, and the client's retry with the same key runs, billed once;
- the row's own commit under way is waited for: committed, the client gets the answer it is billed for, and a
  retry its replay; refused by the database, nothing is written, the claim is given up and the retry runs once.

Before, the client was told 503 in both cases while the row (and the answer with it) still committed later: billed
for an answer it never received, replayed to a retry with the key, and billed again on a retry without one. Chat
and embeddings alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from quotas.ledger_rows import Refusal
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


class StuckWriter:
    """The gateway's ledger writer held in a commit of refusal counts alone (a slow disk) until the block ends: the
    rows submitted meanwhile stay queued behind it, past the ledger's wait (`WAIT_S`)."""

    def __init__(self, gw: Gateway) -> None:
        self.ledger = gw.app.state.services.pipeline.settler.ledger
        self.ledger.record_timeout_s = WAIT_S
        self.stuck, self.released = threading.Event(), threading.Event()
        self.armed = False
        real = self.ledger._commit

        def commit(conn: Any, rows: list[Any], counts: Any, **kwargs: Any) -> list[Exception | None]:
            if self.armed and not rows:
                self.armed = False
                self.stuck.set()
                assert self.released.wait(15)
            return real(conn, rows, counts, **kwargs)

        self.ledger._commit = commit

    def __enter__(self) -> StuckWriter:
        self.armed = True
        self.ledger.submit_refusal(Refusal("stuck", time.time(), "t", "k", "rpm", 429))  # wakes the writer
        assert self.stuck.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()


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
def test_a_late_row_under_way_that_commits_is_the_answer_and_replayed_to_the_retry(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    disk = SlowDisk(gw).arm()  # the row's own commit held past the wait, then committed
    r = send(gw, "order-1")
    assert disk.done.is_set()
    assert r.status_code == 200, r.text  # the answer the row bills, once it committed: not a 503
    assert [row.request_id for row in rows_of(gw, tier)] == [r.headers["x-tiergate-request-id"]]
    again = send(gw, "order-1")  # the client's retry with the same key
    assert again.status_code == 200, again.text
    assert again.headers.get(REPLAY) == "true"  # the answer the tenant was billed for, not a second run
    assert len(rows_of(gw, tier)) == 1
    if route == "chat":
        assert len(gw.stub.requests) == 1


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_late_row_still_queued_is_withdrawn_and_the_retry_runs_billed_once(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    with StuckWriter(gw):
        r = send(gw, "order-2")
        assert r.status_code == 503, r.text  # the row was not durable in time: withdrawn, the client told so
        assert r.json()["error"]["code"] == "ledger_unavailable"
    again = send(gw, "order-2")  # the retry with the same key runs: nothing of the first was kept (a wait at most)
    assert again.status_code == 200, again.text
    assert again.headers.get(REPLAY) is None
    rows = rows_of(gw, tier)
    assert [row.request_id for row in rows] == [again.headers["x-tiergate-request-id"]], \
        f"billed {len(rows)} times for one key: {[(row.status, row.price_usd) for row in rows]}"
    if route == "chat":
        assert len(gw.stub.requests) == 2
    replay = send(gw, "order-2")
    assert replay.status_code == 200 and replay.headers.get(REPLAY) == "true"  # the retry's answer is the key's


@pytest.mark.parametrize("route", ["chat", "embeddings"])
def test_a_late_row_refused_for_good_gives_the_claim_up_and_the_retry_runs_once(gw: Gateway, route: str) -> None:
    send, tier = ROUTES[route]
    if route == "embeddings":
        warm_embeddings(gw)
    disk = SlowDisk(gw, fail=True).arm()  # the row's own commit under way past the wait, then refused
    r = send(gw, "order-3")
    assert disk.done.is_set()
    assert r.status_code == 500, r.text  # the row's own error (not ours to retry), with nothing billed
    assert rows_of(gw, tier) == []
    again = send(gw, "order-3")  # the row never was: the claim is given up, and the retry runs (a wait at most)
    assert again.status_code == 200, again.text
    assert again.headers.get(REPLAY) is None
    assert len(rows_of(gw, tier)) == 1  # the retry's own: one row in all
    if route == "chat":
        assert len(gw.stub.requests) == 2
