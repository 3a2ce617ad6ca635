"""The engine's body limit is the gateway's (gateway/settings.py `max_body_bytes`), not Litestar's default 10 MB:
a larger body is a 413 in OpenAI's error shape, refused before it is parsed. `engine serve --max-body-bytes` sets it,
and the gateway's supervisor passes its own setting (a body the gateway takes, its engine takes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

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
