"""A client that leaves before the first token still pays for the prompt the tier was sent: the tier may have run its
prefill, and a remote tier (or a text completion on any tier) sends nothing before its first token. Through a real
gateway in front of an upstream that takes seconds to its first byte and reports usage only at the end, as a remote
OpenAI-compatible server does. A call that fails on our side (the tier timed out) stays unbilled."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from gateway.pipeline.meter import Meter
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState, free_port, health_routes, openai_tiers, write_settings

PREFILL_S = 5.0  # the upstream's time to its first byte; the client leaves long before
READ_TIMEOUT_S = 2.0  # the gateway's wait for the upstream's next bytes: it gives up before the prefill ends
PROMPT = "word " * 400
PLANS = """
default_plan: billed
plans:
  billed:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    cache: {enabled: false}
    limits: {rpm: 1000, tpm: 1000000}
"""


def slow_prefill_app(state: StubState) -> Litestar:
    """An upstream that is silent for PREFILL_S (its prefill) on a long prompt, then streams two words; no usage."""
    async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
        if PROMPT in json.dumps(body):
            await asyncio.sleep(PREFILL_S)
        for word in ("Hello", " there"):
            chunk = {"id": "r", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @post(["/v1/chat/completions", "/v1/completions"], status_code=200)
    async def answer(request: Request[Any, Any, Any]) -> Response[Any]:
        body = json.loads(await request.body())
        state.requests.append(body)
        return Stream(events(body), media_type="text/event-stream")

    return Litestar([*health_routes("remote"), answer])


def billed_settings(tmp_path: Path, models_dir: Path, url: str, **overrides: Any) -> Settings:
    """`mid` and `full` the OpenAI-compatible server at `url`, `small` a port nothing listens on; plan `billed`."""
    tiers = openai_tiers({"small": {"url": f"http://127.0.0.1:{free_port()}"}, "mid": {"url": url},
                          "full": {"url": url}},
                         model="remote", price_per_1k_input="0.0010", price_per_1k_output="0.0020")
    return write_settings(tmp_path, models_dir, tiers, PLANS, **overrides)


@pytest.fixture
def gateway(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    state = StubState()
    with ServerThread(slow_prefill_app(state)).start() as upstream:
        settings = billed_settings(tmp_path, prepared_models, upstream.url, upstream_read_timeout_s=READ_TIMEOUT_S)
        with running_gateway(settings, state, plan="billed") as gw:
            yield gw


def leave_early(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    """Send the request and leave before the upstream's first byte (and before the gateway would give up on it)."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gw.url}{path}", json=body, timeout=0.5, headers={"authorization": f"Bearer {gw.tenant_key}"})


def rows_when(gw: Gateway, n: int) -> list[Any]:
    deadline = time.time() + 10
    while len(rows := gw.ledger_rows()) < n and time.time() < deadline:
        time.sleep(0.05)
    return rows


def test_a_client_that_leaves_during_the_prefill_pays_for_its_prompt(gateway: Gateway) -> None:
    chat = {"model": "mid", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
    text = {"model": "mid", "max_tokens": 2, "prompt": PROMPT}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        for stream in (False, True):
            leave_early(gateway, path, body | {"stream": stream})
    rows = rows_when(gateway, 4)
    assert len(gateway.stub.requests) == 4  # each one reached the tier, which began its prefill
    assert [(r.status, r.http_status) for r in rows] == [("cancelled", 499)] * 4
    assert all(r.input_tokens >= 400 and r.output_tokens == 0 and r.price_usd > 0 for r in rows), rows
    # the tokens-per-minute window holds what they used, not nothing (their settles are handed off: waited for here)
    deadline = time.time() + 5
    while True:
        with gateway.client(gateway.tenant_key) as c:
            r = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        used = 1_000_000 - int(r.headers["x-ratelimit-remaining-tokens"])
        if used >= sum(row.input_tokens for row in rows) or time.time() > deadline:
            break
        time.sleep(0.1)
    assert used >= sum(row.input_tokens for row in rows)


def test_a_call_that_fails_on_our_side_is_not_billed(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:  # the client waits; the gateway gives up on the silent tier
        r = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code >= 500, r.text
    [row] = rows_when(gateway, 1)
    assert (row.status, row.input_tokens, row.price_usd) == ("error", 0, 0)


def test_the_meters_rule_for_a_prompt_without_usage() -> None:
    """Billed: a tier that answered, or a client that left once the request was on its way; not billed: a client
    that left before (waiting for a slot), or a call that failed before any chunk."""
    def outcome(status: str, *, sent: bool) -> tuple[int, int]:
        meter = Meter(time.perf_counter(), counted_input=37)
        if sent:
            meter.upstream_started()
        out = meter.outcome(status, 499 if status == "cancelled" else 504, output_delivered=status != "error")
        return out.input_tokens, out.output_tokens

    assert outcome("cancelled", sent=True) == (37, 0)
    assert outcome("cancelled", sent=False) == (0, 0)
    assert outcome("error", sent=True) == (0, 0)
