"""An engine with a key (TIERGATE_ENGINE_API_KEY) answers only callers that send it, /health aside, and refuses
before reading the body; one with no key refuses to serve beyond this host unless told to; the gateway reaches a keyed
remote engine through the tier's api_key_env, and never hands its own engine key to the local engines it starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from assets.engine_key import ENGINE_API_KEY_ENV
from engine.engine_auth import ExposureError, check_exposure
from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from gateway.cli.main import cli
from tests.conftest import running_gateway
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread, StubState, openai_tiers, write_settings
from wire.errors import MAX_BODY_BYTES

KEY = "engine-secret-Zq81"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PLANS = """
default_plan: standard
plans:
  standard:
    allowed_tiers: [mid, full]
    default_tier: mid
    cache: {enabled: false}
"""


@pytest.fixture
def engine_url() -> Iterator[str]:
    eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1", api_key=KEY)).start()
    try:
        yield str(server.url)
    finally:
        server.stop()
        eng.shutdown()


@pytest.mark.parametrize("sent", [None, "Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}",
                                  f"Bearer  {KEY}"])
def test_a_keyed_engine_refuses_a_caller_without_its_key(engine_url: str, sent: str | None) -> None:
    headers = {} if sent is None else {"authorization": sent}
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                         ("GET", "/metrics")):
        r = httpx.request(method, f"{engine_url}{path}", headers=headers, timeout=10,
                          json=CHAT if method == "POST" else None)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        assert KEY not in r.text and (sent is None or sent not in r.text)  # what was sent is not echoed


def test_a_keyed_engine_serves_its_key_and_leaves_health_open(engine_url: str) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{engine_url}/v1/chat/completions", json=CHAT, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    lower = httpx.post(f"{engine_url}/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer {KEY}"},
                       timeout=10)
    assert lower.status_code == 200, lower.text  # the scheme's case is free
    assert httpx.get(f"{engine_url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "tiny"
    open_health = httpx.get(f"{engine_url}/health", timeout=10).json()
    assert open_health["status"] == "ok" and "stats" not in open_health  # the load: for callers with the key
    assert "kv_utilisation_others" in httpx.get(f"{engine_url}/health", headers=auth, timeout=10).json()["stats"]


def test_the_key_is_checked_before_the_body_is_read(engine_url: str) -> None:
    """A body over the limit from a caller without the key is a 401, not a 413: nothing of it is read."""
    body = b'{"model": "tiny", "messages": []' + b" " * MAX_BODY_BYTES + b"}"
    r = httpx.post(f"{engine_url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_an_engine_without_a_key_may_serve_this_host(host: str) -> None:
    check_exposure(host, None, allow_unauthenticated=False, key_env=ENGINE_API_KEY_ENV)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "engine.internal"])
def test_an_engine_without_a_key_refuses_to_serve_beyond_this_host(host: str) -> None:
    with pytest.raises(ExposureError, match=ENGINE_API_KEY_ENV):
        check_exposure(host, None, allow_unauthenticated=False, key_env=ENGINE_API_KEY_ENV)
    check_exposure(host, KEY, allow_unauthenticated=False, key_env=ENGINE_API_KEY_ENV)
    check_exposure(host, None, allow_unauthenticated=True, key_env=ENGINE_API_KEY_ENV)


@pytest.mark.parametrize("key", ["clé-secret", "two words", "tab\tkey", "\x7fdel"])
def test_a_key_no_header_can_carry_as_sent_is_refused_at_start(key: str) -> None:
    """A UTF-8 key never matched (the header arrives as latin-1) and the gateway's client cannot send one at all:
    every caller was locked out of an engine that started fine."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ExposureError, match=ENGINE_API_KEY_ENV) as exc:
            check_exposure(host, key, allow_unauthenticated=False, key_env=ENGINE_API_KEY_ENV)
        assert key not in str(exc.value)  # the variable is named, the value never shown


def test_engine_serve_on_the_network_without_a_key_exits_before_loading_the_model(tmp_path: Path) -> None:
    env = {ENGINE_API_KEY_ENV: ""}
    result = CliRunner().invoke(cli, ["engine", "serve", "--model", str(tmp_path / "no-such-model"), "--host",
                                      "0.0.0.0", "--port", "1", "--data-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2, result.output
    assert ENGINE_API_KEY_ENV in result.output and "--allow-unauthenticated" in result.output


def test_the_gateway_reaches_a_keyed_remote_engine_through_api_key_env(
        engine_url: str, tmp_path: Path, prepared_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMOTE_ENGINE_KEY", KEY)
    tier = {"url": engine_url, "model": "tiny", "api_key_env": "REMOTE_ENGINE_KEY"}
    settings = write_settings(tmp_path, prepared_models, openai_tiers({"mid": tier, "full": tier}), PLANS)
    with running_gateway(settings, StubState()) as gw, gw.client(gw.tenant_key) as c:  # waits for both to be ready
        r = c.post("/v1/chat/completions", json={**CHAT, "model": "mid"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_local_engines_do_not_inherit_the_gateways_engine_key(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    from tests.tiers.test_core_budget import catalogue, fleet

    monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
    engines = fleet(catalogue("mid"), [0], tmp_path)._engines
    assert engines and all(ENGINE_API_KEY_ENV not in e.env() for e in engines)
    assert all(e.env()["PATH"] == os.environ["PATH"] for e in engines)  # the rest of the environment is passed on

