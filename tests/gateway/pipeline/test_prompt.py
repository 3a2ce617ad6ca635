"""The prompt stage reads tenant text in bounded, linear work: the ladder's input cap drops turns in one pass
with a bounded number of exact counts, and text that cannot fit is refused without being tokenized."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import InvalidRequest, Unavailable
from gateway.ladder.apply import NORMAL, Degradation
from gateway.ladder.config import CapInputTokens
from gateway.pipeline import prompt as prompt_module
from gateway.pipeline.prompt import MAX_RECOUNTS, ContextTooLong, PromptStage, _trim
from gateway.token_counter import TokenCounter, token_counter
from tests.conftest import MODELS_DIR
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest


@pytest.fixture(scope="module")
def counter(prepared_models: Path) -> TokenCounter:
    return token_counter(MODELS_DIR / "smollm2-135m-instruct")


def tier(context: int = 8192) -> TierSpec:
    return TierSpec.model_validate({"name": "mid", "backend": "local", "model": "smollm2-135m-instruct",
                                    "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                    "hardware_cost_per_hour": "1", "context_limit": context})


def naive_trim(counter: TokenCounter, messages: list[dict[str, Any]], cap: int) -> list[int]:
    """The reference: drop the oldest droppable turn and count again, until it fits (quadratic)."""
    kept = list(range(len(messages)))
    while counter.prompt_tokens([messages[i] for i in kept]) > cap:
        droppable = [i for i in kept[:-1] if messages[i]["role"] != "system"]
        if not droppable:
            break
        kept.remove(droppable[0])
    return kept


def conversation(rng: random.Random, n: int) -> list[dict[str, Any]]:
    words = ["alpha", "beta", "gamma", "delta", "why", "how", "the", "a", "42", "x²", "日本", "über", "\n"]
    out = [{"role": "system", "content": "You are terse."}] if rng.random() < 0.5 else []
    for i in range(n):
        out.append({"role": "user" if i % 2 == 0 else "assistant",
                    "content": " ".join(rng.choice(words) for _ in range(rng.randint(0, 60)))})
    return out


def test_the_input_cap_drops_what_the_naive_loop_drops(counter: TokenCounter) -> None:
    rng = random.Random(7)
    for _ in range(40):
        messages = conversation(rng, rng.randint(1, 30))
        cap = rng.randint(30, 600)
        assert _trim(counter, messages, cap) == naive_trim(counter, messages, cap)


def test_the_input_cap_counts_a_bounded_number_of_times_however_long_the_conversation(
        counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    # The template's per-message markers are measured once per counter and role, with two exact counts each
    # (TokenCounter.message_overhead), on the first trim of that counter in the process: counts of no conversation.
    # `token_counter` is shared by the process, so whether an earlier test had measured them depended on which tests
    # a pytest-xdist worker had run before this one; run first (or alone) this test saw 4 counts more than its bound.
    for role in ("system", "user", "assistant"):
        counter.message_overhead(role)
    calls: list[int] = []
    real, here = TokenCounter.prompt_tokens, threading.get_ident()

    def counted(self: TokenCounter, ms: Any, owner: Any = None, user: Any = None, **kw: Any) -> int:
        if threading.get_ident() == here:  # a gateway another test left running in this process counts too
            calls.append(len(ms))
        return real(self, ms, owner, user, **kw)

    monkeypatch.setattr(TokenCounter, "prompt_tokens", counted)
    rng = random.Random(3)
    for n in (100, 2000):
        calls.clear()
        _trim(counter, conversation(rng, n), 200)
        assert len(calls) <= MAX_RECOUNTS + 1
        assert max(calls) < 200  # turns that cannot fit by their length were never rendered


def test_text_that_cannot_fit_is_refused_unread(counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tokenizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenized text that cannot fit")

    monkeypatch.setattr(TokenCounter, "count", no_tokenizing)
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    req = ChatCompletionRequest.model_validate(
        {"model": "mid", "messages": [{"role": "user", "content": "9" * (256 * counter.max_token_chars + 1)}]})
    with pytest.raises(InvalidRequest) as err:
        asyncio.run(stage.measure(req, tier(256), NORMAL))
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"


def test_a_long_prompt_is_refused_on_its_prefix(counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = TokenCounter.count
    monkeypatch.setattr(TokenCounter, "count", lambda self, text: seen.append(len(text)) or real(self, text))
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    text = " ".join(random.Random(1).choice(["cat", "dog", "fish"]) for _ in range(12_000))  # ~12k tokens, 48k chars
    req = ChatCompletionRequest.model_validate({"model": "mid", "messages": [{"role": "user", "content": text}]})
    with pytest.raises(InvalidRequest):
        asyncio.run(stage.measure(req, tier(1024), NORMAL))
    assert seen == [1024 * prompt_module.PREFIX_CHARS_PER_TOKEN]  # only the prefix was read


def test_the_cap_is_reported_and_the_count_is_exact(counter: TokenCounter) -> None:
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    messages = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and now?"}]
    req = ChatCompletionRequest.model_validate({"model": "mid", "messages": messages})
    degr = Degradation(2, (CapInputTokens(cap_input_tokens=64),))
    got = asyncio.run(stage.measure(req, tier(), degr))
    assert got.applied == ("cap_input_tokens(64,dropped=1)",)
    assert [m.text() for m in got.messages] == ["ok", "and now?"]
    assert got.num_tokens == counter.prompt_tokens([{"role": m.role, "content": m.text()} for m in got.messages])


def test_warm_loads_each_tiers_tokenizer_once_and_leaves_an_unprepared_one_to_the_request(
        prepared_models: Path, tmp_path: Path) -> None:
    missing = TierSpec.model_validate({"name": "gone", "backend": "local", "model": "no-such-model",
                                       "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                       "hardware_cost_per_hour": "1", "context_limit": 8192})
    token_counter.cache_clear()
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    assert stage.warm([tier(), missing, tier(4096)]) == ["smollm2-135m-instruct"]
    assert token_counter.cache_info().currsize == 1  # loaded before any request: none pays it on the event loop
    with pytest.raises(Unavailable, match="not prepared"):  # the request still says why: a 503, not a bare Exception
        asyncio.run(stage.measure(ChatCompletionRequest.model_validate(
            {"model": "gone", "messages": [{"role": "user", "content": "hi"}]}), missing, NORMAL))


def test_an_unprepared_tokenizer_tells_the_tenant_which_tier_and_the_log_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tenant reads which tier cannot take its request; the models directory's paths, the loader's words and the
    command to run are the operator's, logged once, not once a request."""
    missing = TierSpec.model_validate({"name": "gone", "backend": "local", "model": "no-such-model",
                                       "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                       "hardware_cost_per_hour": "1", "context_limit": 8192})
    stage = PromptStage(models_dir=tmp_path / "models", default_max_tokens=64)
    req = ChatCompletionRequest.model_validate({"model": "gone", "messages": [{"role": "user", "content": "hi"}]})
    with caplog.at_level(logging.ERROR, logger="tiergate.prompt"):
        for _ in range(2):
            with pytest.raises(Unavailable) as caught:
                asyncio.run(stage.measure(req, missing, NORMAL))
            err = caught.value
            assert err.code == "tokenizer_unavailable" and err.retry_after == 30
            assert err.message == ("tier 'gone' cannot take requests now: its model is not prepared on this gateway; "
                                   "retry later")
    assert len(caplog.records) == 1 and "tiergate models fetch --model no-such-model" in caplog.text


def test_a_started_gateway_has_its_tiers_tokenizers_before_its_first_request(gateway_settings: Any, stub: Any) -> None:
    from tests.conftest import running_gateway

    token_counter.cache_clear()
    with running_gateway(gateway_settings, stub[1]):
        assert token_counter.cache_info().currsize >= 1


def test_a_tokenizer_that_fails_its_warm_up_does_not_stop_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def prompt_tokens(self, messages: Any) -> int:
            raise RuntimeError("a template that needs a system turn")

    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    monkeypatch.setattr(stage, "_counter", lambda tier: Broken())
    assert stage.warm([tier()]) == []  # logged and left to the request path, which reports it to the client


def test_a_prompt_of_many_short_messages_is_counted_off_the_event_loop(
        counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline path is for prompts whose count takes microseconds. 2,048 empty messages have no content
    characters, but the template writes ~28 characters of markers for each: a 57 KB prompt of 10k tokens, which
    rendered and counted on the event loop took it 27-42 ms for a 70 KB body (then refused as too long, charged
    its bytes only)."""
    on_loop: list[str] = []
    real_render, real_count = TokenCounter.render, TokenCounter.count

    def render(self: TokenCounter, messages: Any) -> str:
        if threading.current_thread() is threading.main_thread():
            on_loop.append("render")
        return real_render(self, messages)

    def count(self: TokenCounter, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            on_loop.append("count")
        return real_count(self, text)

    monkeypatch.setattr(TokenCounter, "render", render)
    monkeypatch.setattr(TokenCounter, "count", count)
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    req = ChatCompletionRequest.model_validate(
        {"model": "mid", "messages": [{"role": "user", "content": ""} for _ in range(2048)]})
    got = asyncio.run(stage.measure(req, tier(32768), NORMAL, owner="acme"))
    assert got.num_tokens > 10_000
    assert on_loop == []


@pytest.mark.parametrize("turns", [prompt_module.INLINE_MESSAGES, 2048], ids=["inline", "worker-thread"])
def test_a_prompt_refused_after_its_count_is_charged_what_was_rendered(counter: TokenCounter, turns: int) -> None:
    """A prompt that fits, but not with its max_tokens, is refused after a full count, and charged (to the tenant's
    refused-work allowance, gate.py) the characters tokenized: the rendered prompt, the template's markers and default
    system prompt included. Many tiny messages are almost no content (2 characters each was all they were charged)
    and ~30 characters each rendered."""
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    messages = [{"role": "user", "content": "hi"} for _ in range(turns)]
    req = ChatCompletionRequest.model_validate({"model": "mid", "max_tokens": 32768, "messages": messages})
    with pytest.raises(ContextTooLong) as err:
        asyncio.run(stage.measure(req, tier(32768), NORMAL, owner="acme"))
    assert "prompt tokens + 32768 output tokens" in str(err.value)  # counted in full, then refused
    assert err.value.tokenized_chars >= len(counter.render(messages)) > 10 * turns


def test_a_long_prompts_floor_is_never_above_its_count(counter: TokenCounter) -> None:
    """`size`'s floor is what the pipeline holds while a long prompt is counted (handle.py): above the count, a
    request that fits would be refused for its floor. Random conversations, with and without the input cap and
    max_tokens; the short ones are counted inline and hold none."""
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    rng = random.Random(11)
    capped = Degradation(2, (CapInputTokens(cap_input_tokens=300),))
    longs = 0
    for _ in range(60):
        body: dict[str, Any] = {"model": "mid", "messages": conversation(rng, rng.randint(1, 120))}
        if rng.random() < 0.5:
            body["max_tokens"] = rng.randint(1, 200)
        req = ChatCompletionRequest.model_validate(body)
        for degr in (NORMAL, capped):
            unread = stage.size(req, tier(), degr)
            got = asyncio.run(stage.measure(req, tier(), degr, unread=unread))
            if unread.inline:
                assert unread.floor == 0
                continue
            longs += 1
            assert unread.floor_input <= got.num_tokens and 0 < unread.floor_output <= got.output_cap
    assert longs > 40


def test_size_refuses_text_that_cannot_fit_unread(counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by its length before anything is held or read: not even rendered."""
    monkeypatch.setattr(TokenCounter, "render", lambda *a: pytest.fail("rendered text that cannot fit"))
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    req = ChatCompletionRequest.model_validate(
        {"model": "mid", "messages": [{"role": "user", "content": "9" * (256 * counter.max_token_chars + 1)}]})
    with pytest.raises(ContextTooLong) as err:
        stage.size(req, tier(256), NORMAL)
    assert err.value.code == "context_length_exceeded" and err.value.tokenized_chars == 0


def test_a_distilled_student_not_built_yet_names_its_build_command_as_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The `small` tier on a first `make run`: its student is being built (serve starts the distill), so its tokenizer
    is missing for a while. The log said ERROR and `tiergate models fetch --model students/...`, a command that cannot
    fetch a student; it now names the tier's own build command, as a warning."""
    student = TierSpec.model_validate({"name": "small", "backend": "local", "model": "students/no-such-student",
                                       "distill": {"teacher": "mid", "layers": 4, "budget": "10m"},
                                       "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                       "hardware_cost_per_hour": "1", "context_limit": 8192})
    stage = PromptStage(models_dir=tmp_path / "models", default_max_tokens=64)
    req = ChatCompletionRequest.model_validate({"model": "small", "messages": [{"role": "user", "content": "hi"}]})
    with caplog.at_level(logging.INFO, logger="tiergate.prompt"), pytest.raises(Unavailable):
        asyncio.run(stage.measure(req, student, NORMAL))
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "models fetch" not in record.getMessage()
    assert "tiergate models distill --teacher mid --layers 4" in record.getMessage()
