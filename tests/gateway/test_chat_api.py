"""POST /v1/chat/completions through a real gateway in front of a stub upstream."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import openai
import pytest

from gateway.tenants.store_sqlite import FOLLOW_EVERY_S
from tests.conftest import Gateway
from tests.stubs import REPLY

N = len(REPLY.split())

MSG = [{"role": "user", "content": "hello there"}]


def test_non_stream_answer_headers_and_ledger_row(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == REPLY
    assert body["model"] == "mid" and r.headers["x-tiergate-tier"] == "mid"
    rid = r.headers["x-tiergate-request-id"]
    assert body["id"] == f"chatcmpl-{rid}"
    assert "default" in r.headers["x-tiergate-route-reason"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": N, "total_tokens": 2 + N}
    (row,) = gateway.ledger_rows()
    assert (row.request_id, row.tenant, row.tier, row.status, row.http_status) == (rid, "acme", "mid", "ok", 200)
    assert (row.input_tokens, row.output_tokens) == (2, N)
    # mid: $0.001 / 1K in, $0.002 / 1K out; exact decimals
    assert row.price_usd == Decimal("0.001") * 2 / 1000 + Decimal("0.002") * N / 1000
    # busy time reported by the upstream (0.001 s per token) × $3.60 / hour
    assert row.cost_basis == "engine" and row.compute_cost_usd == Decimal("3.60") * Decimal("0.001") * N / 3600
    assert row.ttft_s is not None and row.total_s >= row.ttft_s


def test_upstream_gets_the_tier_model_and_sampling_fields(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "full", "messages": MSG, "max_completion_tokens": 3,
                                                 "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["x"],
                                                 "user": "u1"})
    assert r.status_code == 200
    sent = gateway.stub.requests[-1]
    assert sent["model"] == "stub-full" and sent["stream"] is True
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["seed"], sent["stop"]) == (
        3, 0.5, 0.9, 7, ["x"])
    assert "max_completion_tokens" not in sent
    assert r.json()["choices"][0]["finish_reason"] == "length"
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "full", "messages": MSG}).status_code == 200
    # no cap asked: the gateway reserves, and forwards, its default cap
    assert gateway.stub.requests[-1]["max_tokens"] == gateway.settings.default_max_tokens


def test_stream_with_usage_is_valid_sse_and_ledger_is_written_before_done(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "full", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        rows_at_done = gateway.ledger_rows()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == REPLY
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N
    assert all(ch["usage"] is None for ch in chunks[:-1])
    assert all("x_tiergate" not in ch for ch in chunks)
    assert len(rows_at_done) == 1 and rows_at_done[0].status == "ok"


def test_openai_client_stream_and_not(gateway: Gateway) -> None:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key) as client:
        out = client.chat.completions.create(model="auto", messages=MSG, max_tokens=16)
        assert out.choices[0].message.content == REPLY and out.usage.completion_tokens == N
        stream = client.chat.completions.create(model="full", messages=MSG, stream=True,
                                                stream_options={"include_usage": True})
        parts, usage = [], None
        for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
            if ch.usage:
                usage = ch.usage
        assert "".join(parts) == REPLY and usage is not None and usage.total_tokens == 2 + N
        models = {m.id for m in client.models.list()}
    assert models == {"auto", "small", "mid", "full", "all-MiniLM-L6-v2"}  # the tiers, `auto` and the embedder


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    (b"{not json", 400, "invalid_json", None),
    (b"", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    (b'{"model": "auto"}', 400, "missing", "messages"),
    (b'{"model": "auto", "messages": []}', 400, "too_short", "messages"),
    (b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400, "int_type",
     "max_tokens"),
    (b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "temperature": 9}', 400, "less_than_equal",
     "temperature"),
    (b'{"model": "auto", "messages": [{"role": "wizard", "content": "x"}]}', 400, "literal_error",
     "messages.0.role"),
    (b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "unsupported_value", "n"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found", "model"),
    (b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "priority": 1}', 400,
     "unsupported_parameter", "priority"),
    (b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": '
     b'{"include_usage": true, "continuous_usage_stats": true}}', 400, "unsupported_parameter",
     "stream_options.continuous_usage_stats"),
])
def test_bad_requests_get_openai_errors_and_spend_nothing(gateway: Gateway, body: bytes, status: int, code: str,
                                                          param: str | None) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param and err["message"]
    assert r.headers["x-tiergate-request-id"] and r.headers["x-tiergate-tier"] == "none"
    assert gateway.ledger_rows() == [] and gateway.stub.requests == []


def test_huge_body_is_413(gateway: Gateway) -> None:
    big = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "x" * 100_000}]})
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert gateway.ledger_rows() == []


def test_keys_missing_unknown_revoked_expired_are_401(gateway: Gateway) -> None:
    expires_at = time.time() + 3.0  # room for a slow machine to send the requests before it
    _, plaintext = gateway.store.issue_key("acme", expires_at=expires_at)
    with gateway.client() as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
    with gateway.client("tg-000000000000-nope") as c:
        r = c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with gateway.client(plaintext) as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
        time.sleep(max(0.0, expires_at - time.time()) + 0.1)
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
    # revoked through a second connection (as the CLI does): takes effect once the gateway next reads the store's
    # change counter (at most FOLLOW_EVERY_S later)
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 200
        gateway.store.revoke_key(gateway.tenant_key[3:15])
        time.sleep(FOLLOW_EVERY_S)
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 401
    assert len(gateway.ledger_rows()) == 2


def test_plan_forbids_tier_and_admin_keys_cannot_call_models(gateway: Gateway) -> None:
    gateway.store.create_tenant("tiny", "smallonly")
    _, key = gateway.store.issue_key("tiny")
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", json={"model": "full", "messages": MSG})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # its only tier is down and the plan does not allow upgrades: 503 with Retry-After
        r = c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG})
        assert r.status_code == 503 and r.headers["retry-after"] and "small" in r.json()["error"]["message"]
    with gateway.client(gateway.admin_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG}).status_code == 403
    assert gateway.ledger_rows() == []


def test_unavailable_tier_is_routed_around_and_reported(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "small", "messages": MSG})
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid"
    assert "small unavailable" in r.headers["x-tiergate-route-reason"]
    assert models["small"]["available"] is False and models["small"]["unavailable_reason"]
    assert models["mid"]["available"] is True
    assert gateway.ledger_rows()[0].route_reason.startswith("small unavailable")


def test_upstream_rejection_is_relayed_and_recorded(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "STUB:400"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    (row,) = gateway.ledger_rows()
    assert (row.status, row.http_status, row.error_code, row.price_usd) == ("error", 400, "context_length_exceeded", 0)


def test_upstream_dying_mid_stream_ends_the_stream_with_an_error(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "mid", "messages": [{"role": "user", "content": "STUB:die"}], "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert "error" in json.loads(events[-1])
    (row,) = gateway.ledger_rows()
    assert row.status == "error" and row.output_tokens == 2


def test_client_disconnect_cancels_upstream_and_records_usage_so_far(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "mid", "messages": [{"role": "user", "content": "STUB:slow"}], "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]  # role chunk, blank, first word, blank
        assert any("Hello" in line for line in got)
    deadline = time.time() + 5
    while time.time() < deadline and not (gateway.ledger_rows() and gateway.stub.finished):
        time.sleep(0.05)
    (row,) = gateway.ledger_rows()
    assert row.status == "cancelled" and 1 <= row.output_tokens < N
    assert gateway.stub.finished == ["disconnected"]


def test_openai_client_error_types(gateway: Gateway) -> None:
    with (openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client,
          pytest.raises(openai.NotFoundError)):
        client.chat.completions.create(model="nope", messages=MSG)
    with (openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="tg-000000000000-x", max_retries=0) as bad,
          pytest.raises(openai.AuthenticationError)):
        bad.chat.completions.create(model="auto", messages=MSG)


def test_a_tenant_sending_refused_bodies_by_the_megabyte_is_slowed_and_others_are_not(gateway: Gateway) -> None:
    """A refused body costs its parse and charges nothing: past its bucket of refused bytes (here 2 KB, refilled at
    1 KB/s) a tenant's requests are refused at the gate for a while, and another tenant's are not."""
    gate = gateway.app.state.services.pipeline.gate
    gate.refused_bytes_burst, gate.refused_bytes_per_s = 2000, 1000
    bad = {"model": "mid", "messages": [{"role": "user", "content": "x" * 1500, "bogus": 1}]}
    with gateway.client(gateway.tenant_key) as c:
        first, second = (c.post("/v1/chat/completions", json=bad) for _ in range(2))
        third = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert first.status_code == second.status_code == 400
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_invalid_requests"
    assert int(third.headers["retry-after"]) >= 1
    gateway.store.create_tenant("beta", "standard")
    _, beta = gateway.store.issue_key("beta")
    with gateway.client(beta) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
    assert len(gateway.stub.requests) == 1  # only beta's reached a tier
