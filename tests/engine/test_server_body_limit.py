"""The engine's body limit is the gateway's (gateway/settings.py `max_body_bytes`), not Litestar's default 10 MB:
a larger body is a 413 in OpenAI's error shape, refused before it is parsed. `engine serve --max-body-bytes` sets it,
and the gateway's supervisor passes its own setting (a body the gateway takes, its engine takes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import engine.server
from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread
from wire.errors import MAX_BODY_BYTES


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[tuple[ServerThread, LLMEngine]] = []

    def start(**limit: int) -> str:
        eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer())
        eng.start()
        server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1", **limit)).start()
        started.append((server, eng))
        return str(server.url)

    yield start
    for server, eng in started:
        server.stop()
        eng.shutdown()


def body_of(size: int) -> bytes:
    """A valid chat body of `size` bytes (padded with whitespace)."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'
    return body + b" " * (size - len(body) - 1) + b"}"


def test_a_body_over_the_gateways_limit_is_a_413_in_openais_shape(serve: Any) -> None:
    url = serve()
    r = httpx.post(f"{url}/v1/chat/completions", content=body_of(MAX_BODY_BYTES + 1),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("invalid_request_error", "payload_too_large")
    assert str(MAX_BODY_BYTES) in err["message"]
    ok = httpx.post(f"{url}/v1/chat/completions", content=body_of(MAX_BODY_BYTES),
                    headers={"content-type": "application/json"}, timeout=10)
    assert ok.status_code == 200


def test_the_limit_is_the_engines_to_set(serve: Any) -> None:
    url = serve(max_body_bytes=1000)
    r = httpx.post(f"{url}/v1/chat/completions", content=body_of(1001),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert httpx.post(f"{url}/v1/chat/completions", content=body_of(1000),
                      headers={"content-type": "application/json"}, timeout=10).status_code == 200


def test_a_large_body_slow_to_validate_holds_no_health_probe(serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MB body of a json_schema with 290K properties took 1.3 s to validate and refuse, on the engine's event loop:
    /health and every other request waited behind it, and a few such bodies at once outlast a supervisor's probe.
    Here the validation of a large body (1 MiB, well above what is validated on the loop) waits until /health has
    answered: validated on the loop, /health could not answer."""
    real, started, release = engine.server.parse_body, threading.Event(), threading.Event()

    def slow(body: bytes, kind: Any) -> Any:
        if len(body) >= 1 << 20:
            started.set()
            release.wait(timeout=30)
        return real(body, kind)

    monkeypatch.setattr(engine.server, "parse_body", slow)
    url = serve()
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{url}/v1/chat/completions", content=body_of(1 << 20),
                          headers={"content-type": "application/json"}, timeout=60)
        try:
            assert started.wait(timeout=10)
            health = httpx.get(f"{url}/health", timeout=5)
        finally:
            release.set()
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert big.result().status_code == 200  # then validated and answered as before
