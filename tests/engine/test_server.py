"""The engine's OpenAI-compatible server over real HTTP, with a scripted runner."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread

MSG = [{"role": "user", "content": "capital of France?"}]


@pytest.fixture
def served() -> Iterator[tuple[str, LLMEngine, ScriptedRunner]]:
    runner = ScriptedRunner(step_s=0.002, max_model_len=512)
    eng = LLMEngine(runner, CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    yield server.url, eng, runner
    server.stop()
    eng.shutdown()


def test_non_stream_and_stream_with_the_openai_client(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none") as client:
        out = client.chat.completions.create(model="tiny", messages=MSG, temperature=0)
        assert out.choices[0].message.content == "Paris is the capital." and out.choices[0].finish_reason == "stop"
        assert out.usage.prompt_tokens == len("<user>capital of France?>")
        stream = client.chat.completions.create(model="tiny", messages=MSG, stream=True, max_tokens=5,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Paris"
        assert chunks[-1].usage.completion_tokens == 5
        assert [m.id for m in client.models.list()] == ["tiny"]


def test_penalties_reach_the_sampler_and_a_bad_one_is_a_400_naming_it(
        served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, runner = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none") as client:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, presence_penalty=0.5,
                                       frequency_penalty=-1.25)
        params = runner.steps[-1].seqs[0].params
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.25) and params.penalized
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, frequency_penalty=2)
        params = runner.steps[-1].seqs[0].params
        assert (params.presence_penalty, params.frequency_penalty) == (0.0, 2.0)
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
        assert not runner.steps[-1].seqs[0].params.penalized
    for value in (2.5, -3, "0.5", True):
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"model": "tiny", "messages": MSG, "frequency_penalty": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty", r.text


def test_continuous_usage_and_busy_time(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    body = {"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counted = [e["usage"]["completion_tokens"] for e in events if e.get("usage") and e["choices"]]
    assert counted == [1, 2]  # the third token arrives with the finish chunk
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["x_tiergate"]["busy_s"] > 0


def test_logprobs_in_openai_shape_streamed_and_not(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        resp = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2)
        content = resp.choices[0].logprobs.content
        assert [c.token for c in content] == ["P", "a", "r"]  # the scripted reply's first 3 tokens
        assert all(c.logprob == -0.25 and len(c.top_logprobs) == 2 for c in content)
        assert content[0].bytes == list(b"P")
        plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
        assert plain.choices[0].logprobs is None
        streamed = [lp.token for ch in client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3,
                                                                     logprobs=True, stream=True)
                    for c in ch.choices if c.logprobs and c.logprobs.content for lp in c.logprobs.content]
        assert streamed == ["P", "a", "r"]
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "top_logprobs": 2})
    assert bad.status_code == 400 and "top_logprobs needs logprobs" in bad.text


def test_errors(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    health = httpx.get(f"{url}/health").json()
    assert health["model_version"] == "v1"
    assert health["stats"]["kv_utilisation"] == 0.0 and health["stats"]["num_running"] == 0
    assert health["stats"]["kv_utilisation_others"] == 0.0  # the ladder's reading (tiers/fleet.py)
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("tiergate_engine_generation_tokens_total", "tiergate_engine_kv_blocks_used",
                 "tiergate_engine_kv_blocks_free", "tiergate_engine_prefix_cache_hit_rate",
                 "tiergate_engine_generation_tokens_per_second", "tiergate_engine_running_seqs"):
        assert name in metrics


@pytest.mark.parametrize("stop", ["", ["x", ""]])
def test_an_empty_stop_string_is_a_400_naming_stop(served: tuple[str, LLMEngine, ScriptedRunner],
                                                    stop: str | list[str]) -> None:
    """It stops nowhere, and was dropped unsaid (the answer ran on as without it); vLLM refuses it, so a tier on
    vLLM answered the same request with a 400."""
    url, _, _ = served
    for path, body in (("chat/completions", {"messages": MSG}), ("completions", {"prompt": "capital of"})):
        r = httpx.post(f"{url}/v1/{path}", json={"model": "tiny", **body, "stop": stop, "max_tokens": 5})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == ("stop" if stop == "" else "stop.1")


def test_a_request_larger_than_the_kv_cache_is_a_400_not_a_crash() -> None:
    runner = ScriptedRunner(max_model_len=4096, num_kv_blocks=4, block_size=16)  # 64 tokens of KV in all
    eng = LLMEngine(runner, CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 100})
        assert r.status_code == 400 and "KV cache holds 64 tokens" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"
    finally:
        server.stop()
        eng.shutdown()


def test_disconnect_aborts_within_a_step_and_frees_the_sequence(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, eng, runner = served
    runner.step_s = 0.05
    body = {"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 400}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        stats = eng.stats()
        assert stats.num_running + stats.num_waiting == 1
    deadline = time.time() + 5
    while time.time() < deadline and (eng.stats().num_running or eng.stats().num_waiting):
        time.sleep(0.01)
    stats = eng.stats()
    assert stats.num_running == 0 and len(runner.released) == 1 and stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_leaves_a_whole_answer_aborts_it(served: tuple[str, LLMEngine, ScriptedRunner],
                                                       path: str) -> None:
    """Not streamed, nothing is sent before the answer is whole: the disconnect itself must stop it (it ran on to
    max_tokens for no one, holding its slot and KV blocks)."""
    url, eng, runner = served
    runner.step_s = 0.5  # its 22 tokens: 11 s
    body = {"model": "tiny", "max_tokens": 400, **({"messages": MSG} if "chat" in path else {"prompt": "capital"})}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}{path}", json=body, timeout=0.5)
    deadline = time.time() + 4  # aborted within a step; run to its end, it would still be running
    while time.time() < deadline and (eng.stats().num_running or eng.stats().num_waiting):
        time.sleep(0.01)
    stats = eng.stats()
    assert stats.num_running == stats.num_waiting == 0 and len(runner.released) == 1 and stats.num_kv_blocks_used == 0


@pytest.mark.parametrize(("field", "value"), [("seed", 2**64), ("seed", -1), ("temperature", 1e-40),
                                              ("top_p", 0), ("stop", ["x"] * 5), ("top_logprobs", 21)])
def test_a_bad_sampling_parameter_is_a_400_naming_it(served: tuple[str, LLMEngine, ScriptedRunner], field: str,
                                                      value: object) -> None:
    url, eng, _ = served
    body = {"model": "tiny", "messages": MSG, "temperature": 1.0, "logprobs": True, field: value}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field
    assert httpx.get(f"{url}/health").json()["status"] == "ok" and eng.dead_reason is None


def test_the_largest_seed_samples(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "seed": 2**64 - 1,
                                                       "temperature": 0.5})
    assert r.status_code == 200


def test_health_reports_the_instance_the_supervisor_gave(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer())
    monkeypatch.setenv("TIERGATE_ENGINE_INSTANCE", "nonce-123")
    with_nonce = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    monkeypatch.delenv("TIERGATE_ENGINE_INSTANCE")
    without = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        assert httpx.get(f"{with_nonce.url}/health").json()["instance"] == "nonce-123"
        assert httpx.get(f"{without.url}/health").json()["instance"] is None
    finally:
        with_nonce.stop()
        without.stop()


class CountingTokenizer(CharTokenizer):
    """Counts tokenizer calls; each takes `delay_s` (a huge prompt)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.calls += 1
        time.sleep(self.delay_s)
        return super().__call__(text, add_special_tokens)


def slowest_health_while(url: str, body: dict[str, object]) -> tuple[float, httpx.Response]:
    """Post `body` and poll /health until it is answered; the slowest /health and the answer."""
    slowest = 0.0
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=60)
        time.sleep(0.05)
        while not chat.done():
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.02)
        return slowest, chat.result()


def test_tokenizing_a_prompt_does_not_block_the_server() -> None:
    tokenizer = CountingTokenizer(delay_s=2.0)
    eng = LLMEngine(ScriptedRunner(max_model_len=512), tokenizer)
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        slowest, answer = slowest_health_while(server.url, {"model": "tiny", "messages": MSG, "max_tokens": 3})
        assert answer.status_code == 200 and tokenizer.calls == 1
        assert slowest < 0.8, f"/health took {slowest:.2f}s while a prompt was tokenized (2 s)"
    finally:
        server.stop()
        eng.shutdown()


def byte_level_tokenizer() -> Any:
    """A real transformers fast tokenizer (byte-level, one token per byte), to test the GIL, not a stand-in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>"
    return tok


def test_a_real_tokenizer_on_a_megabyte_prompt_lets_the_event_loop_run() -> None:
    # transformers' call releases the GIL (tokenizers' encode_batch); `Tokenizer.encode` would hold it
    # for the whole 1-2 s this takes here (measured: /health then takes 1.5 s; with the call, under 0.3 s)
    eng = LLMEngine(ScriptedRunner(max_model_len=2_000_000), byte_level_tokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        huge = [{"role": "user", "content": "hello world 123 " * 60_000}]
        slowest, answer = slowest_health_while(server.url, {"model": "tiny", "messages": huge, "max_tokens": 3})
        assert answer.status_code == 400 and "KV cache holds" in answer.json()["error"]["message"]  # tokenized
        assert slowest < 0.8, f"/health took {slowest:.2f}s while a 1 MB prompt was tokenized"
    finally:
        server.stop()
        eng.shutdown()


def test_text_longer_than_the_context_could_hold_is_refused_before_tokenizing() -> None:
    tokenizer = CountingTokenizer()
    eng = LLMEngine(ScriptedRunner(max_model_len=512), tokenizer)  # one character per token at most: 512
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 600}]}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "messages" and tokenizer.calls == 0
    finally:
        server.stop()
        eng.shutdown()


PROMPT = "The capital of France is"


def test_text_completions_with_the_openai_client_streamed_and_not(
        served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=50, temperature=0)
        assert out.object == "text_completion" and out.id.startswith("cmpl-")
        assert out.choices[0].text == "Paris is the capital." and out.choices[0].finish_reason == "stop"
        assert out.usage.prompt_tokens == len(PROMPT)  # the prompt as it is: no chat template around it
        assert out.model_extra["x_tiergate"]["busy_s"] > 0
        listed = client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=50)  # a list of one prompt
        assert listed.choices[0].text == "Paris is the capital."
        default_cap = client.completions.create(model="tiny", prompt=PROMPT)  # the legacy default: 16 tokens
        assert default_cap.choices[0].text == "Paris is the cap" and default_cap.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "Paris"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(PROMPT)


def test_text_completion_logprobs_in_the_legacy_shape(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        lp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=2).choices[0].logprobs
        assert lp.tokens == ["P", "a", "r"] and lp.token_logprobs == [-0.25] * 3
        assert lp.top_logprobs[0] == {"P": -0.25, "Q": -1.5}  # the scripted token and its neighbour
        assert lp.text_offset == [len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]  # counted from the prompt's start
        streamed = [c.choices[0].logprobs for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1, stream=True) if c.choices and c.choices[0].logprobs]
        assert [t for s in streamed for t in s.tokens] == ["P", "a", "r"]
        assert [o for s in streamed for o in s.text_offset] == lp.text_offset
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices[0].logprobs is None


def test_continuous_usage_of_a_text_stream(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["object"] == "text_completion" for e in events)
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage") and e["choices"]] == [1, 2]
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["x_tiergate"]["busy_s"] > 0


@pytest.mark.parametrize(("field", "value", "code"), [
    ("echo", True, "unsupported_value"), ("suffix", "x", "unsupported_parameter"),
    ("best_of", 2, "unsupported_value"), ("n", 2, "unsupported_value"), ("logprobs", 6, "less_than_equal"),
    ("prompt", [1, 2, 3], "unsupported_value"), ("prompt", ["a", "b"], "unsupported_value"),
    ("seed", -1, "greater_than_equal"), ("stop", ["x"] * 5, "too_long"), ("messages", MSG, "unsupported_parameter"),
    ("logit_bias", {"5": 1}, "unsupported_value"), ("presence_penalty", 2.5, "less_than_equal"),
])
def test_a_text_completion_parameter_we_do_not_serve_is_a_400_naming_it(
        served: tuple[str, LLMEngine, ScriptedRunner], field: str, value: object, code: str) -> None:
    url, _, _ = served
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == code


def test_text_completion_limits_name_the_prompt(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, _ = served
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 600})  # the context is 512
    assert r.status_code == 400 and r.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["gpt-4o", "TINY", "tiny ", "tiny@v2", "mid"])
def test_a_model_the_engine_does_not_serve_is_a_404_and_nothing_runs(
        served: tuple[str, LLMEngine, ScriptedRunner], path: str, stream: bool, model: str) -> None:
    """The engine serves its one model (`--served-name`, the tier's name when the gateway starts it), as vLLM and
    OpenAI do: any other name is refused before anything is tokenized or generated, not answered by this model."""
    url, eng, runner = served
    body = {"model": model, "max_tokens": 3, "stream": stream,
            **({"messages": MSG} if "chat" in path else {"prompt": "capital"})}
    r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                     "code": "model_not_found"}
    assert f"`{model}`" in err["message"] and "`tiny`" in err["message"]  # what was asked, what is served
    assert not runner.steps and eng.stats().num_prompt_tokens_total == 0
    body["model"] = "tiny"  # the served name answers as before
    assert httpx.post(f"{url}{path}", json=body).status_code == 200


def test_the_openai_sdk_reads_an_unknown_model_as_not_found(served: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, _, runner = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=MSG)
        assert info.value.code == "model_not_found" and info.value.param == "model"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="capital")
    assert not runner.steps
