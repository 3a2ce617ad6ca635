"""The token counter remembers counts for the tenant that sent the text only (gateway/token_counter.py's
`CountMemo`): another tenant's count of the same text is counted afresh (a remembered one answered faster: a timing
oracle of other tenants' prompts), one tenant's texts never evict another's, and a tenant's own conversation still
has its earlier turns counted once. Checked by the tokenizing calls made, not by timing."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from gateway import token_counter as tc
from gateway.ladder.apply import NORMAL, Degradation
from gateway.ladder.config import CapInputTokens
from gateway.pipeline.prompt import PromptStage
from gateway.token_counter import TokenCounter
from tests.conftest import MODELS_DIR
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest

TIER = TierSpec.model_validate({"name": "mid", "backend": "local", "model": "smollm2-135m-instruct",
                                "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                "hardware_cost_per_hour": "1", "context_limit": 8192})


@pytest.fixture
def counted(prepared_models: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TokenCounter, list[str]]:
    """A counter with nothing remembered, and the pieces it tokenizes (every short prompt's tokenizing goes there)."""
    counter = TokenCounter(MODELS_DIR / "smollm2-135m-instruct")
    assert counter._cut is not None  # SmolLM2's tokenizer: short prompts are counted by pieces
    pieces: list[str] = []
    real = counter._piece_tokens
    monkeypatch.setattr(counter, "_piece_tokens", lambda piece: pieces.append(piece) or real(piece))
    return counter, pieces


def secret() -> str:
    return f"my card number is {uuid.uuid4().hex} and my question is about tax"


def measure(stage: PromptStage, owner: str, messages: list[dict[str, str]], degr: Degradation = NORMAL) -> int:
    req = ChatCompletionRequest.model_validate({"model": "mid", "messages": messages})
    return asyncio.run(stage.measure(req, TIER, degr, owner=owner)).num_tokens


@pytest.fixture
def stage(counted: tuple[TokenCounter, list[str]], monkeypatch: pytest.MonkeyPatch) -> PromptStage:
    stage = PromptStage(models_dir=MODELS_DIR, default_max_tokens=64)
    monkeypatch.setattr(stage, "_counter", lambda tier: counted[0])
    return stage


def test_another_tenants_text_is_counted_afresh(stage: PromptStage, counted: tuple[TokenCounter, list[str]]) -> None:
    counter, pieces = counted
    text = secret()
    messages = [{"role": "user", "content": text}]
    first = measure(stage, "alice", messages)
    assert sum(text in p for p in pieces) == 1
    pieces.clear()
    assert measure(stage, "mallory", messages) == first
    assert sum(text in p for p in pieces) == 1  # tokenized again: nothing of alice's was reused
    assert counter._recent.get("mallory", counter.render(messages)) is not None  # mallory's own, now
    pieces.clear()
    assert measure(stage, "alice", messages) == first and pieces == []  # alice's retry: remembered for her


def test_a_tenants_conversation_counts_its_earlier_turns_once(stage: PromptStage,
                                                              counted: tuple[TokenCounter, list[str]]) -> None:
    _, pieces = counted
    turns = [{"role": "user", "content": secret()}]
    measure(stage, "alice", turns)
    for i in range(3):
        pieces.clear()
        turns += [{"role": "assistant", "content": f"answer {i} {uuid.uuid4().hex}"},
                  {"role": "user", "content": f"follow-up {i} {uuid.uuid4().hex}"}]
        measure(stage, "alice", turns)
        assert [p for p in pieces if "answer" in p or "follow-up" in p] == [f"assistant\n{turns[-2]['content']}",
                                                                          f"user\n{turns[-1]['content']}"]
        assert not any(turns[0]["content"] in p for p in pieces)  # the first turn: counted once, in the first request


def test_the_worker_thread_path_keeps_the_tenants_memo_too(stage: PromptStage,
                                                           counted: tuple[TokenCounter, list[str]]) -> None:
    counter, pieces = counted
    text = secret()
    messages = [{"role": "user", "content": "old " * 20}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": text}]
    capped = Degradation(2, (CapInputTokens(cap_input_tokens=4000),))  # counted by `_trim`, in a worker thread
    measure(stage, "alice", messages, capped)
    assert any(text in t for t in counter._pieces.texts("alice"))
    assert not any(text in t for t in counter._pieces.texts(None))  # not the gateway's own memo, not shared
    pieces.clear()
    measure(stage, "mallory", messages, capped)
    assert sum(text in p for p in pieces) == 1


def test_one_tenant_cannot_evict_anothers_counts(counted: tuple[TokenCounter, list[str]]) -> None:
    counter, pieces = counted
    mine = [{"role": "user", "content": secret()}]
    counter.prompt_tokens(mine, "alice")
    kept = counter._pieces.texts("alice"), counter._recent.texts("alice")
    for i in range(tc.RECENT_PIECES + 10):  # more than a tenant's share of pieces
        counter.prompt_tokens([{"role": "user", "content": f"flood {i}"}], "mallory")
    assert len(counter._pieces.texts("mallory")) <= tc.RECENT_PIECES
    assert (counter._pieces.texts("alice"), counter._recent.texts("alice")) == kept
    pieces.clear()
    counter.prompt_tokens(mine, "alice")
    assert pieces == []


def test_a_memo_keeps_to_its_bound_in_characters() -> None:
    memo = tc.CountMemo(entries=100, chars=50)
    for i in range(10):
        memo.put("a", f"{i}" * 20, i)
    assert memo.texts("a") == ["8" * 20, "9" * 20]  # the newest that fit in 50 characters
    memo.put("a", "x" * 51, 1)  # longer than the bound: not remembered
    assert memo.get("a", "x" * 51) is None and memo.get("b", "9" * 20) is None
    assert tc.RECENT_CHARS * 4 <= 1 << 20  # a tenant's memo: at most a MiB of text, however wide its characters


def test_a_prompt_sent_again_is_not_rendered_again_for_its_tenant_only(
        stage: PromptStage, counted: tuple[TokenCounter, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """From its third send a tenant's prompt is counted from its turns, without the template's render; another
    tenant's same turns are rendered and tokenized afresh (no count of alice's reused for mallory)."""
    counter, pieces = counted
    renders: list[object] = []
    real = counter.render
    monkeypatch.setattr(counter, "render", lambda messages: renders.append(messages) or real(messages))
    text = secret()
    messages = [{"role": "user", "content": text}]
    first = measure(stage, "alice", messages)
    assert measure(stage, "alice", messages) == first and len(renders) == 2  # the second: rendered, then remembered
    renders.clear()
    pieces.clear()
    assert measure(stage, "alice", messages) == first and renders == [] and pieces == []  # the third: from its turns
    assert measure(stage, "mallory", messages) == first
    assert len(renders) == 1 and sum(text in p for p in pieces) == 1  # mallory's: rendered and tokenized
    renders.clear()
    other = [{"role": "user", "content": text + " and more"}]
    assert measure(stage, "alice", other) != first and len(renders) == 1  # other turns: rendered


@pytest.mark.parametrize("degr", [NORMAL, Degradation(2, (CapInputTokens(cap_input_tokens=4000),))])
def test_an_isolated_end_users_counts_are_remembered_for_that_end_user(
        stage: PromptStage, counted: tuple[TokenCounter, list[str]], degr: Degradation) -> None:
    """Under a plan isolating its end users, another end user of the tenant timed its count of a text one had sent;
    counts are remembered for the tenant and the end user (the tenant's own, none named, stay shared), in the
    tenant's one memo, which no number of end users grows."""
    counter, pieces = counted
    text = secret()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": text}]  # a turn the cap may drop: counted by `_trim`, in a worker thread

    def measured(user: str | None) -> int:
        req = ChatCompletionRequest.model_validate({"model": "mid", "messages": messages})
        return asyncio.run(stage.measure(req, TIER, degr, owner="clinic", user=user)).num_tokens

    first = measured("user=alice")
    assert measured("user=alice") == first and sum(text in p for p in pieces) == 1  # her own: remembered
    assert measured("user=bob") == first and sum(text in p for p in pieces) == 2  # bob's: counted afresh
    assert measured(None) == first and sum(text in p for p in pieces) == 3
    assert measured(None) == first and sum(text in p for p in pieces) == 3
    assert set(counter._pieces._shelves) - {None} == {"clinic"}  # one tenant's bound, whoever its end users are
