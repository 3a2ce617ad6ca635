"""A tenant's `max_concurrent` holds across the replicas that share a Redis: a request counts in the quota store until
its answer is handed over to its client, not only until it is settled.

Its place in the replica's own gate was held that long already (tests/gateway/test_whole_answer_holds_place.py), but
the store's slot, the one every replica reads, was freed at the settle, before a byte of a JSON body was written: a
tenant allowed one request at a time whose client read nothing had an answer of megabytes waiting on every replica
at once. Here two gateways on one redis-server: while replica a's answer waits unread, the tenant's next request
through replica b is refused 429 for its concurrency; once the client takes the answer, or resets the connection
mid-body, the slot is freed, once, and b admits the next. And a client that sends its next request through b as soon
as it has a's answer whole (a stream's `[DONE]`) is admitted: the last piece is written once Redis has freed the slot,
even where Redis answers late."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_whole_answer_holds_place import (
    BIG_CHAT,
    BIG_EMBEDDINGS,
    SEND_BUFFER,
    counted_releases,
    request_id,
    reset,
    unread,
    wait_for,
)
from tests.stubs import ServerThread, StubState

SINGLE = """
  single:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {max_concurrent: 1}
"""
HI = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}
SLOW_RELEASE_S = 0.5  # how late the store answers a slot's release


@pytest.fixture
def replicas(gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str,
             tmp_path: Path) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways on one Redis, tenant `acme` on a plan of one request at a time on each."""
    plans = tmp_path / "single-plans.yaml"
    plans.write_text(gateway_settings.plans_file.read_text() + SINGLE)
    base = gateway_settings.model_copy(update={"redis_url": redis_url, "plans_file": plans})
    one = base.model_copy(update={"data_dir": tmp_path / "a"})
    two = base.model_copy(update={"data_dir": tmp_path / "b"})
    with running_gateway(one, stub[1], plan="single", send_buffer=SEND_BUFFER) as a, \
            running_gateway(two, stub[1], plan="single", send_buffer=SEND_BUFFER) as b:
        yield a, b


def post(gw: Gateway, path: str, body: dict[str, Any]) -> Any:
    with gw.client(gw.tenant_key) as c:
        return c.post(path, json=body)


def assert_refused_for_concurrency(gw: Gateway) -> None:
    refused = post(gw, "/v1/chat/completions", HI)
    # before: 200, replica a's request settled, and its slot freed, before its answer's body was written
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_concurrency", refused.text


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", BIG_CHAT), ("/v1/embeddings", BIG_EMBEDDINGS)],
                         ids=["chat", "embeddings"])
def test_an_unread_answer_on_one_replica_holds_the_slot_on_the_other_until_its_client_is_gone(
        replicas: tuple[Gateway, Gateway], path: str, body: dict[str, Any]) -> None:
    a, b = replicas
    with counted_releases(a) as releases:
        sock, head = unread(a, path, a.tenant_key, body)
        rid = request_id(head)
        try:
            assert head.startswith(b"http/1.1 200"), head
            assert_refused_for_concurrency(b)
            assert rid not in releases
        finally:
            reset(sock)  # the client gone mid-body: the send fails, the slot is freed all the same
        wait_for(lambda: rid in releases, "the slot of a request whose client reset it was never freed")
        assert post(b, "/v1/chat/completions", HI).status_code == 200
        assert releases.count(rid) == 1 and len(set(releases)) == len(releases), releases  # each freed once


def test_an_answer_read_whole_frees_the_slot_once_for_every_replica(replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    with counted_releases(a) as releases:
        sock, head = unread(a, "/v1/chat/completions", a.tenant_key, BIG_CHAT)
        rid = request_id(head)
        try:
            assert head.startswith(b"http/1.1 200"), head
            assert_refused_for_concurrency(b)
            length = int(next(line for line in head.split(b"\r\n") if line.startswith(b"content-length:"))
                         .split(b":")[1])
            got = b""
            while len(got) < length:  # the client takes its answer, whole
                got += sock.recv(1 << 16)
            assert json.loads(got)["choices"][0]["message"]["content"].startswith("y")
        finally:
            sock.close()
        wait_for(lambda: rid in releases, "the slot of an answer handed over was never freed")
        assert post(b, "/v1/chat/completions", HI).status_code == 200
        assert post(a, "/v1/chat/completions", HI).status_code == 200
        assert releases.count(rid) == 1 and len(set(releases)) == len(releases), releases


@contextmanager
def slow_releases(gw: Gateway) -> Iterator[None]:
    """The gateway's store frees each kept slot SLOW_RELEASE_S after it is asked to (a Redis far away, or busy)."""
    backend = gw.app.state.services.pipeline.reserve.quotas.backend
    release = type(backend).release

    async def slow(req: Any) -> None:
        await asyncio.sleep(SLOW_RELEASE_S)
        await release(backend, req)

    backend.release = slow
    try:
        yield
    finally:
        del backend.release


def slots_in_redis(url: str) -> int:
    """The concurrency slots Redis holds, every tenant's and scope's."""
    r = redis.Redis.from_url(url)
    try:
        return sum(int(r.zcard(key)) for key in r.scan_iter(match="*:inflight"))
    finally:
        r.close()


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", HI), ("/v1/chat/completions", BIG_CHAT),
                                            ("/v1/embeddings", BIG_EMBEDDINGS)],
                         ids=["one-piece", "many-pieces", "embeddings"])
def test_a_client_that_has_its_whole_answer_finds_the_slot_free_on_every_replica(
        replicas: tuple[Gateway, Gateway], redis_url: str, path: str, body: dict[str, Any]) -> None:
    """Before: the last piece was written as the slot's release was begun, in a task, and a client that read its answer
    and at once sent its next request through the other replica was refused 429 for its concurrency until Redis had
    run the release (here half a second later)."""
    a, b = replicas
    with slow_releases(a), a.client(a.tenant_key) as c:
        assert c.post(path, json=body).status_code == 200  # read whole
        assert slots_in_redis(redis_url) == 0  # at once: before, still 1
        nxt = post(b, "/v1/chat/completions", HI)
        assert nxt.status_code == 200, nxt.text


def test_a_stream_client_that_has_its_done_finds_the_slot_free_on_every_replica(
        replicas: tuple[Gateway, Gateway], redis_url: str) -> None:
    """A stream's place is given back once its work ends, before its `[DONE]` is written: that waits on the store."""
    a, b = replicas
    with slow_releases(a), a.client(a.tenant_key) as c, \
            c.stream("POST", "/v1/chat/completions", json={**HI, "stream": True}) as streamed:
        assert streamed.status_code == 200
        lines = streamed.iter_lines()
        assert any(line == "data: [DONE]" for line in lines)  # read up to its [DONE], and no further yet
        assert slots_in_redis(redis_url) == 0  # before: still 1
        nxt = post(b, "/v1/chat/completions", HI)
        assert nxt.status_code == 200, nxt.text
