"""bench/hostile_tenant.py's NaN and header floods, wired: their bodies and headers are what their names say, sized by
the gateway's limits, and, against a gateway on the stub upstream (no engine), each is refused as meant while the
victim's requests succeed beside it. Nothing here is timed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bench.hostile_floods import header_flood, nan_wide
from bench.hostile_tenant import Attack, Served, attacks, run_phase
from gateway.http_responses import MAX_HEAD_BYTES, MAX_HEADERS
from tests.conftest import Gateway
from wire.body_width import MAX_ITEMS, MAX_MESSAGES

FOUR_MIB = 4 * 1024 * 1024  # the gateway's default body limit


def not_json(raw: bytes) -> bool:
    def refuse(literal: str) -> None:
        raise ValueError(literal)

    try:
        json.loads(raw, parse_constant=refuse)
    except ValueError:
        return True
    return False


def test_the_nan_body_is_as_wide_as_the_body_limit_allows() -> None:
    body = nan_wide(FOUR_MIB)
    parsed = json.loads(body)  # Python's json reads NaN; RFC 8259 does not
    parts = sum(len(m["content"]) for m in parsed["messages"])
    assert FOUR_MIB - 8 * 1024 < len(body) <= FOUR_MIB
    assert parts == 160_512 > MAX_ITEMS and len(parsed["messages"]) <= MAX_MESSAGES  # looked at by the width check
    assert body.count(b"NaN") == 1 and b'"parameters":{"type":"object","x":NaN}' in body and not_json(body)
    assert len(nan_wide(64 * 1024)) <= 64 * 1024  # a smaller TIERGATE_MAX_BODY_BYTES, a smaller body


def head_of(headers: list[tuple[str, str]]) -> tuple[int, int]:
    """Header lines and bytes of a request with `headers` and the 4 that bench/hostile_floods.raw_post adds."""
    added = [("host", "127.0.0.1:65535"), ("authorization", "Bearer " + "k" * 60), ("content-type", "application/json"),
             ("content-length", "2")]
    lines = [*added, *headers]
    return len(lines), len("POST /v1/chat/completions HTTP/1.1\r\n\r\n") + sum(len(k) + len(v) + 4 for k, v in lines)


def test_the_header_flood_is_at_then_past_each_limit() -> None:
    at_limit, many, big = (head_of(h) for h in header_flood())
    assert at_limit[0] == MAX_HEADERS and MAX_HEAD_BYTES - 8 * 1024 < at_limit[1] < MAX_HEAD_BYTES
    assert many[0] > MAX_HEADERS and many[1] < MAX_HEAD_BYTES  # refused for the count alone
    assert big[0] < MAX_HEADERS and big[1] > 256 * 1024  # for the size alone: past one of asyncio's reads


@pytest.fixture
def served(gateway: Gateway) -> Iterator[Served]:
    """The test gateway (stub tiers, a 64 KiB body limit) as the bench sees `tiergate serve`, its attacker a tenant
    of its own."""
    gateway.store.create_tenant("mallory", "standard")
    _, attacker = gateway.store.issue_key("mallory", name="bench")
    yield Served(gateway.url, None, gateway.admin_key, gateway.tenant_key,  # type: ignore[arg-type]
                 attacker_key=attacker, max_body_bytes=gateway.settings.max_body_bytes)


def new_attacks(s: Served) -> dict[str, Attack]:
    found = {"nan": [a for a in attacks(s) if "NaN" in a.name], "headers": [a for a in attacks(s)
                                                                               if "header flood" in a.name]}
    assert all(len(v) == 1 for v in found.values()), found  # each chosen by `--attacks NaN` / `--attacks header`
    return {k: v[0] for k, v in found.items()}


def test_each_flood_is_refused_as_meant(served: Served) -> None:
    new = new_attacks(served)
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {served.attacker_key}"}) as c:
        assert [new["nan"].send(c) for _ in range(2)] == [400, 400]
        assert [new["headers"].send(c) for _ in range(3)] == [431, 431, 400]  # past the size, past the count, read
        r = c.post("/v1/chat/completions", content=nan_wide(served.max_body_bytes),
                   headers={"content-type": "application/json"})
    assert r.json()["error"]["code"] == "invalid_json", r.text


@pytest.mark.parametrize("which", ["nan", "headers"])
def test_a_flood_runs_beside_the_victim(served: Served, which: str) -> None:
    attack = new_attacks(served)[which]
    phase = run_phase(served, attack.name, 2, attack)
    assert len(phase.victim_s) == 2 and not phase.victim_failed, phase.victim_failed
    assert phase.attacker and set(phase.attacker) <= {400, 429, 431}, dict(phase.attacker)  # no transport error (-1)
