"""An upstream's own strings are not trusted text. A tier's 4xx error `code` becomes the tenant's error code, the
ledger row's `error_code` and part of the `x-tiergate-cascade` header; its message becomes log lines and replica
reasons. Whatever an upstream sends (CR/LF, ten kilobytes, unicode), what reaches a header, a label, a ledger row or
a log line is a short token or an escaped, bounded quote."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, Request, Response, post

from gateway.errors import InvalidRequest, UpstreamError, client_error
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_routing_api import LADDER, PLANS, empty_stub, tiers_yaml, with_difficulty_model
from tests.stubs import ServerThread, StubState, health_routes, stub_app
from tiers import errors as tier_errors

MSG = [{"role": "user", "content": "easy"}]
# what a hostile (or broken) upstream puts in its error's `code`
HOSTILE_CODES = {
    "crlf": "bad\r\nx-injected: 1\r\n\r\n<html>",
    "10kb": "a" * 10_240,
    "unicode": "ошибка\u2028\u202eevil",
    "trailing newline": "invalid_value\n",  # passes `^[a-z0-9_]+$`, whose `$` matches before a final newline
    "not a string": {"nested": ["x" * 1000]},
}


class Hostile:
    """An OpenAI-compatible upstream that answers every chat with `status` and an error of its choosing."""

    def __init__(self) -> None:
        self.state = StubState()
        self.status = 400
        self.error: dict[str, Any] = {}

        @post("/v1/chat/completions", status_code=200)
        async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
            self.state.requests.append(json.loads(await request.body()))
            return Response({"error": self.error}, status_code=self.status)

        self.server = ServerThread(Litestar([*health_routes("stub-mid"), chat])).start()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    h = Hostile()
    yield h
    h.server.stop()


@pytest.fixture
def cascading_to_hostile(gateway_settings: Settings, hostile: Hostile, tmp_path: Path) -> Iterator[Gateway]:
    """`small` answers empty (so `auto` cascades to `mid`), `mid` is the hostile upstream, `full` a plain stub."""
    small, full = StubState(), StubState()
    servers = [ServerThread(empty_stub(small)).start(), ServerThread(stub_app(full)).start()]
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(servers[0].url, [hostile.server.url], servers[1].url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    (tmp_path / "ladder.yaml").write_text(LADDER)
    settings = gateway_settings.model_copy(update={"ladder_file": tmp_path / "ladder.yaml"})
    try:
        with running_gateway(settings, hostile.state, plan="cascading") as gw:
            with_difficulty_model(gw, tmp_path)
            yield gw
    finally:
        for s in servers:
            s.stop()


def chat(gw: Gateway, model: str) -> Any:
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": model, "messages": MSG})


def clean(text: str, limit: int) -> bool:
    """One line, no control characters, at most `limit` characters."""
    return len(text) <= limit and text.isprintable()


# --- through a running gateway ----------------------------------------------------------------------------------

def test_a_hostile_upstream_code_reaches_no_header_body_ledger_or_metric(cascading_to_hostile: Gateway,
                                                                         hostile: Hostile) -> None:
    gw = cascading_to_hostile
    for name, code in HOSTILE_CODES.items():
        hostile.error = {"message": "the prompt is too long", "type": "invalid_request_error",
                         "param": "messages\r\nx-injected: 1", "code": code}
        # the cascade's retry on `mid` is refused: the first answer stands, the header says why in our words
        r = chat(gw, "auto")
        assert r.status_code == 200, (name, r.text)
        assert r.headers["x-tiergate-cascade"] == "small->mid failed (upstream_rejected)", name
        assert "x-injected" not in r.headers
        # asked of `mid` itself: the tenant's 400, with our code and no param
        r = chat(gw, "mid")
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "upstream_rejected" and err["param"] is None, (name, err)
        assert err["message"] == "the prompt is too long"
        assert all(clean(value, 200) for value in r.headers.values()), name
    codes = {row.error_code for row in gw.ledger_rows() if row.tier == "mid"}
    assert codes == {"upstream_rejected"}
    with gw.client(gw.admin_key) as c:
        metrics = c.get("/metrics").text
    assert "injected" not in metrics and "ошибка" not in metrics and "a" * 100 not in metrics


def test_a_safe_upstream_code_is_kept(cascading_to_hostile: Gateway, hostile: Hostile) -> None:
    hostile.error = {"message": "too long", "type": "invalid_request_error", "param": "messages",
                     "code": "context_length_exceeded"}
    r = chat(cascading_to_hostile, "mid")
    assert r.status_code == 400
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "messages")
    r = chat(cascading_to_hostile, "auto")
    assert r.headers["x-tiergate-cascade"] == "small->mid failed (context_length_exceeded)"


def test_a_hostile_upstream_5xx_message_is_logged_on_one_bounded_line(cascading_to_hostile: Gateway,
                                                                      hostile: Hostile,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    hostile.status = 500
    hostile.error = {"message": "boom\r\n2026-12-01 WARNING tiergate: forged line\n" + "x" * 10_240,
                     "type": "api_error", "code": "engine_error"}
    with caplog.at_level(logging.WARNING):
        r = chat(cascading_to_hostile, "mid")
    assert r.status_code == 502 and "forged" not in r.text
    lines = [rec.getMessage() for rec in caplog.records if "boom" in rec.getMessage()]
    assert lines, caplog.text
    for line in lines:
        assert clean(line, 400), line[:300]
        assert "boom\\r\\n2026-12-01" in line  # escaped, still readable


# --- the mapping itself (gateway/errors.py, tiers/errors.py) ----------------------------------------------------

@pytest.mark.parametrize("code", list(HOSTILE_CODES.values()), ids=list(HOSTILE_CODES))
def test_an_upstream_4xx_code_is_kept_only_as_a_short_safe_token(code: object) -> None:
    body = {"error": {"message": "m" * 10_000, "type": "invalid_request_error", "param": "p" * 10_000, "code": code}}
    err = client_error(tier_errors.UpstreamRejected(400, body))
    assert type(err) is InvalidRequest and err.code == "upstream_rejected" and err.param is None
    assert len(err.message) <= 1_001 and err.message.startswith("m" * 1_000)


@pytest.mark.parametrize(("code", "kept"), [("context_length_exceeded", "context_length_exceeded"),
                                            ("Invalid_Value", "invalid_value"), ("x" * 40, "x" * 40),
                                            ("x" * 41, "upstream_rejected"), ("", "upstream_rejected"),
                                            (400, "upstream_rejected"), ("bad-code", "upstream_rejected")])
def test_which_upstream_codes_are_kept(code: object, kept: str) -> None:
    err = client_error(tier_errors.UpstreamRejected(422, {"error": {"message": "no", "code": code}}))
    assert err.code == kept


def test_an_upstream_rejection_reads_as_one_escaped_bounded_line(caplog: pytest.LogCaptureFixture) -> None:
    message = "line one\r\nline two\x1b[31m" + "é" * 10_000
    exc = tier_errors.UpstreamRejected(503, {"error": {"message": message}})
    assert exc.message == message  # the upstream's own words are kept for whoever may read them whole
    assert clean(str(exc), 300) and str(exc).startswith("'line one\\r\\nline two\\x1b[31m")
    with caplog.at_level(logging.WARNING, logger="tiergate.errors"):
        err = client_error(exc)
    assert type(err) is UpstreamError and err.message == "the tier's backend answered 503"
    (record,) = caplog.records
    assert clean(record.getMessage(), 400), record.getMessage()[:300]


def test_an_upstream_4xx_about_the_tier_is_the_gateways_502_not_the_tenants_400(cascading_to_hostile: Gateway,
                                                                                 hostile: Hostile) -> None:
    """A remote tier whose model name, path or key is wrong answers every request 404, 405, 401...: that is how the
    tier is configured, not the tenant's request (it was the tenant's 400, "The model ... does not exist")."""
    gw = cascading_to_hostile
    hostile.error = {"message": "The model `smollm2-mid` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": "model_not_found"}
    for status in (404, 405, 401, 415):
        hostile.status = status
        r = chat(gw, "mid")
        err = r.json()["error"]
        assert r.status_code == 502 and err["code"] == "upstream_error", (status, err)
        assert "does not exist" not in err["message"] and err["param"] is None, (status, err)  # the log's, not theirs
    hostile.error = {"message": "the prompt is too long", "type": "invalid_request_error", "param": "messages",
                     "code": "context_length_exceeded"}
    for status in (400, 413, 422):  # about the request: the tenant's, in the upstream's words
        hostile.status = status
        r = chat(gw, "mid")
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", (status, err)
        assert err["message"] == "the prompt is too long" and err["param"] == "messages", (status, err)
