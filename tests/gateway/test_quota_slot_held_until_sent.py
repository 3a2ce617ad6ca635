"""A tenant's `max_concurrent` holds across the replicas that share a Redis: a request counts in the quota store until
its answer is handed over to its client, not only until it is settled.

Its place in the replica's own gate was held that long already (tests/gateway/test_whole_answer_holds_place.py), but
the store's slot, the one every replica reads, was freed at the settle, before a byte of a JSON body was written: a
tenant allowed one request at a time whose client read nothing had an answer of megabytes waiting on every replica
at once. Here two gateways on one redis-server: while replica a's answer waits unread, the tenant's next request
through replica b is refused 429 for its concurrency; once the client takes the answer, or resets the connection
mid-body, the slot is freed, once, and b admits the next."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
