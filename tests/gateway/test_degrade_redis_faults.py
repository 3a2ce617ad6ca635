"""On-call's ladder changes with the shared state in Redis (0.5 s timeout) when Redis fails: one error is retried
and the change is made once (its audit event kept once, even when the first try ran and only its reply was lost);
Redis still failing is a 503 in OpenAI's shape that says the ladder's shared state could not be written, with
Retry-After, and the level, the override and the shared state stay as they were. Faults are injected by wrapping the
live store's Redis calls."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from gateway.ladder.state import HISTORY_MESSAGE, READ_MESSAGE, WRITE_MESSAGE
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_degrade_api import LADDER
from tests.stubs import ServerThread, StubState


@pytest.fixture
def laddered(gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str,
             tmp_path: Path) -> Iterator[Gateway]:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    settings = gateway_settings.model_copy(update={"ladder_file": f, "redis_url": redis_url, "ladder_tick_s": 3600})
    with running_gateway(settings, stub[1]) as gw:
        yield gw


def ladder_store(gw: Gateway) -> Any:
    return gw.app.state.services.ladder.store


def failing_writes(store: Any, times: int, *, ran: bool = False) -> None:
    """The store's next `times` MULTI/EXECs raise a timeout; with `ran`, each is executed first (its reply lost)."""
    real = store.redis.pipeline
    left = [times]

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        execute = pipe.execute

        def failing_execute(*a: Any, **k: Any) -> Any:
            if left[0] <= 0:
                return execute(*a, **k)
            left[0] -= 1
            if ran:
                execute(*a, **k)
            raise RedisTimeout("Timeout reading from 127.0.0.1:6379")

        pipe.execute = failing_execute
        return pipe

    store.redis.pipeline = pipeline


def post(gw: Gateway, path: str, body: dict[str, Any] | None = None) -> Any:
    with gw.client(gw.admin_key) as c:
        return c.post(f"/admin/degrade{path}", json=body or {})


def test_one_redis_error_does_not_fail_a_change_and_its_event_is_kept_once(laddered: Gateway) -> None:
    store = ladder_store(laddered)
    failing_writes(store, 1, ran=True)
    r = post(laddered, "/", {"level": 2, "reason": "drill"})
    assert r.status_code == 200, r.text
    assert r.json()["level"] == 2
    events = [json.loads(x) for x in store.redis.lrange(store.events_key, 0, -1)]
    assert [(e["to_level"], e["reason"]) for e in events] == [(2, "manual: drill")]
    real_get = store.redis.get
    failed = [False]

    def get_once_failing(key: str) -> Any:  # a read that fails once is retried too
        if not failed[0]:
            failed[0] = True
            raise RedisConnectionError("Connection reset by peer")
        return real_get(key)

    store.redis.get = get_once_failing
    r = post(laddered, "/auto")
    assert r.status_code == 200, r.text
    assert r.json()["level"] == 0 and failed[0]


def test_redis_failing_a_change_is_a_503_that_says_so_and_changes_nothing(laddered: Gateway) -> None:
    store = ladder_store(laddered)
    failing_writes(store, 10**9)
    for path, body in (("/", {"level": 3, "reason": "incident", "ttl_s": 600}), ("/auto", None)):
        r = post(laddered, path, body)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "ladder_state_unavailable"
        assert "the ladder's shared state could not be written" in error["message"] and "retry" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
    with laddered.client(laddered.admin_key) as c:
        status = c.get("/admin/degrade/").json()
    assert status["level"] == 0 and status["manual"] is None  # this replica's view: as before
    assert store.redis.get(store.state_key) is None  # the shared state: never written


def test_a_redis_fault_is_a_fixed_503_and_its_words_stay_with_operators(
        laddered: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    """Redis's own words (its host and port) never reach the admin's client: the 503 says a fixed sentence, and the
    fault is logged once (not once a request). They were in each message: `(Redis: Timeout reading from ...)`."""
    store = ladder_store(laddered)
    refused = "Error 111 connecting to 10.20.30.40:6379. Connection refused."

    def down(*args: Any, **kwargs: Any) -> Any:
        raise RedisConnectionError(refused)

    failing_writes(store, 10**9)  # a write: "Timeout reading from 127.0.0.1:6379"
    with caplog.at_level(logging.WARNING, logger="tiergate"):
        written = post(laddered, "/", {"level": 3, "reason": "incident"})
        assert written.status_code == 503 and written.json()["error"]["message"] == WRITE_MESSAGE, written.text
        store.redis.get = store.redis.lrange = down
        answers = [post(laddered, "/auto"), post(laddered, "/auto")]
        with laddered.client(laddered.admin_key) as c:
            answers.append(c.get("/admin/degrade/history"))
    for r in [*answers, written]:
        assert r.status_code == 503 and r.json()["error"]["code"] == "ladder_state_unavailable", r.text
        assert [leak for leak in ("10.20.30.40", "6379", "127.0.0.1", "Timeout", "Error 111") if leak in r.text] == []
    assert [r.json()["error"]["message"] for r in answers] == [READ_MESSAGE, READ_MESSAGE, HISTORY_MESSAGE]
    logged = [rec.getMessage() for rec in caplog.records if "ladder store" in rec.getMessage()]
    assert len(logged) == 2, logged  # each fault once: the write's timeout, then the refused connection
    assert "127.0.0.1:6379" in logged[0] and "10.20.30.40:6379" in logged[1]
