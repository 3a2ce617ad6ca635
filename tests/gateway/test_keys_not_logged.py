"""No API key reaches the gateway's logs through the HTTP path: a served request, a wrong key, a key sent where keys
do not go (a query string, the body), a key on an admin route, and an upstream failure (whose error is logged)."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import Gateway


def test_keys_never_reach_the_logs_through_the_api(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("tiergate", "uvicorn", "uvicorn.access", "uvicorn.error", "litestar")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # some do not propagate to the root logger caplog listens on
        logger.addHandler(caplog.handler)
        logger.setLevel(logging.DEBUG)
    try:
        _requests(gateway)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(caplog.handler)
            logger.setLevel(level)
    key, wrong = gateway.tenant_key, _wrong(gateway.tenant_key)
    ours = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]  # not the test's client
    text = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in ours)
    assert ours  # the gateway's logs were captured at all
    for secret in (key, wrong, gateway.admin_key):
        assert secret not in text and secret.split("-", 2)[-1] not in text


def _wrong(key: str) -> str:
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def _requests(gateway: Gateway) -> None:
    key, wrong = gateway.tenant_key, _wrong(gateway.tenant_key)
    chat = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}
    with gateway.client(key) as c:
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        c.post(f"/v1/chat/completions?api_key={key}", json=chat)
        c.post("/v1/chat/completions", json={**chat, "user": key})
        c.post("/v1/chat/completions", json={**chat, "model": key})  # unknown model: refused, named in the error
        assert c.get("/admin/tenants").status_code == 403
    with gateway.client(wrong) as c:
        assert c.post("/v1/chat/completions", json=chat).status_code == 401
    with gateway.client(gateway.admin_key) as c:
        assert c.get("/admin/tenants").status_code == 200
