"""Request ids (`x-tiergate-request-id`, and the `chatcmpl-…`/`cmpl-…` ids built from them): unique, 32 hex digits,
one random prefix per process, and nothing a tenant can count the other tenants' requests from (they were the
prefix and a plain counter of every request the process had served)."""

from __future__ import annotations

import itertools
import re

from gateway.middleware import _RequestIds
from tests.conftest import Gateway

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_ids_are_unique_hex_with_one_prefix_per_process_and_no_counter_in_them() -> None:
    source = _RequestIds()
    assert source.next()[:16] != _RequestIds().next()[:16]  # each process (here: each source) its own prefix
    issued = [source.next() for _ in range(20_000)]
    assert all(HEX32.fullmatch(i) for i in issued) and len(set(issued)) == len(issued)
    assert len({i[:16] for i in issued}) == 1
    tails = [int(i[16:], 16) for i in issued]
    steps = [b - a for a, b in itertools.pairwise(tails)]
    assert sum(1 for s in steps if 0 < s < 2**32) < 20  # a counter steps by 1; a permutation anywhere in 2**64
    assert sum(1 for s in steps if s > 0) < 0.6 * len(steps)  # no order either: about half go up
    assert max(tails) > 2**63 and min(tails) < 2**60  # spread over the whole range, not counted up from 0


def test_a_tenant_cannot_count_the_requests_of_others_from_its_ids(gateway: Gateway) -> None:
    gateway.store.create_tenant("victim", "standard")
    _, victim = gateway.store.issue_key("victim")
    chat = {"model": "mid", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with gateway.client(gateway.tenant_key) as spy, gateway.client(victim) as other:
        first = spy.post("/v1/chat/completions", json=chat)
        for _ in range(37):
            assert other.post("/v1/chat/completions", json=chat).status_code == 200
        second = spy.post("/v1/chat/completions", json=chat)
    assert first.status_code == second.status_code == 200
    a, b = (r.headers["x-tiergate-request-id"] for r in (first, second))
    assert HEX32.fullmatch(a) and HEX32.fullmatch(b) and a[:16] == b[:16]  # one process answered both
    assert first.json()["id"] == f"chatcmpl-{a}" and second.json()["id"] == f"chatcmpl-{b}"
    assert not 0 < int(b[16:], 16) - int(a[16:], 16) < 2**32  # was exactly 38: the victim's 37 requests, and 1
