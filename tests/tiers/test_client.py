"""The tier client against our engine's real server: an error event inside a stream is an error, not content."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, FaultyRunner
from tests.stubs import ServerThread
from tiers.client import TierClient
from tiers.errors import UpstreamRejected


@pytest.fixture
async def engine_url() -> AsyncIterator[tuple[str, LLMEngine]]:
    eng = LLMEngine(FaultyRunner(reply="x" * 400, step_s=0.005, max_model_len=512), CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    yield server.url, eng
    server.stop()
    eng.shutdown()


def body(content: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 300}


async def test_a_failed_request_raises_with_the_engines_error(engine_url: tuple[str, LLMEngine]) -> None:
    url, _ = engine_url
    client = TierClient()
    try:
        chunks = []
        with pytest.raises(UpstreamRejected) as err:
            async for chunk in client.stream_chat(url, body("SAMPLE-FAIL")):
                chunks.append(chunk)
        assert err.value.status == 500 and err.value.body["error"]["code"] == "engine_error"
        assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}]
        good = [c async for c in client.stream_chat(url, body("fine"))]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in good if c["choices"]) == "x" * 300
    finally:
        await client.aclose()


async def test_a_dead_engine_mid_stream_raises_a_503(engine_url: tuple[str, LLMEngine]) -> None:
    url, eng = engine_url
    client = TierClient()

    def scheduler_bug() -> Any:
        raise RuntimeError("scheduler bug")

    try:
        with pytest.raises(UpstreamRejected) as err:
            async for chunk in client.stream_chat(url, body("fine")):
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    eng.scheduler.schedule = scheduler_bug  # type: ignore[method-assign]
        assert err.value.status == 503 and err.value.body["error"]["code"] == "engine_dead"
    finally:
        await client.aclose()


async def test_the_cache_salt_reaches_the_engines_sequence_and_a_bad_one_is_refused(
        engine_url: tuple[str, LLMEngine]) -> None:
    url, eng = engine_url
    client = TierClient()
    try:
        [c async for c in client.stream_chat(url, body("fine"), cache_salt="0123abcd")]
        assert {s.cache_salt for out in eng.model_runner.steps for s in out.seqs} == {"0123abcd"}  # type: ignore[attr-defined]
        with pytest.raises(UpstreamRejected) as err:
            [c async for c in client.stream_chat(url, body("fine"), cache_salt="no spaces allowed")]
        assert err.value.status == 400 and err.value.body["error"]["param"] == "x-tiergate-cache-salt"
    finally:
        await client.aclose()


def test_a_local_tier_gets_the_tenants_salt_and_a_remote_one_none() -> None:
    from gateway.pipeline.tier_call import cache_salt
    from tiers.catalogue import TierSpec

    local = TierSpec.model_construct(name="mid", backend="local")
    remote = TierSpec.model_construct(name="api", backend="openai")
    a, b = cache_salt(local, "acme"), cache_salt(local, "globex")
    assert a and b and a != b and "acme" not in a and a == cache_salt(local, "acme")
    assert cache_salt(remote, "acme") is None and cache_salt(local, None) is None
