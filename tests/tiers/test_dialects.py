"""What a tier's server is sent depends on the dialect it declares: a strict OpenAI-compatible server gets
OpenAI's fields only (it would refuse vLLM's extensions with a 400), vLLM gets usage in every chunk, and the
plan's priority only where the server schedules by it. Only vLLM and our engines sample by `top_k` (routing keeps a
request that sets it off the others); turned off (-1, 0) it is sent to none."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.pipeline.tier_call import upstream_body
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest

PRICES = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002", "hardware_cost_per_hour": "0.1",
          "context_limit": 2048}
REQ = ChatCompletionRequest.model_validate({"model": "mid", "messages": [{"role": "user", "content": "hi"}],
                                            "temperature": 0, "max_tokens": 50})


def remote(dialect: str | None) -> TierSpec:
    extra = {} if dialect is None else {"dialect": dialect}
    return TierSpec(name="mid", backend="openai", model="served-id", urls=["http://x"], **PRICES, **extra)


@pytest.mark.parametrize(("dialect", "continuous", "priority", "top_k"), [
    (None, False, False, False), ("openai", False, False, False), ("vllm", True, False, True),
    ("vllm-priority", True, True, True)])
def test_each_dialect_gets_only_what_its_server_accepts(dialect: str | None, continuous: bool,
                                                        priority: bool, top_k: bool) -> None:
    body = upstream_body(REQ, remote(dialect), max_tokens=20, priority=2, logprobs=False)
    assert body["model"] == "served-id" and body["max_tokens"] == 20 and body["stream"] is True
    assert body["stream_options"]["include_usage"] is True  # every dialect is asked for usage
    assert ("continuous_usage_stats" in body["stream_options"]) is continuous
    assert ("priority" in body) is priority
    assert remote(dialect).samples_top_k is top_k


@pytest.mark.parametrize("dialect", [None, "vllm"])
@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_turned_off_is_sent_to_no_server(dialect: str | None, off: int) -> None:
    body = upstream_body(REQ.model_copy(update={"top_k": off}), remote(dialect), max_tokens=20, priority=0,
                         logprobs=False)
    assert "top_k" not in body  # every server's default; a strict one refuses the field whatever its value
    assert upstream_body(REQ.model_copy(update={"top_k": 5}), remote("vllm"), max_tokens=20, priority=0,
                         logprobs=False)["top_k"] == 5


def test_a_local_tier_speaks_our_engines_dialect_and_no_other() -> None:
    local = TierSpec(name="mid", backend="local", model="smollm2-135m-instruct", **PRICES)
    body = upstream_body(REQ, local, max_tokens=20, priority=1, logprobs=True)
    assert body["model"] == "mid" and body["priority"] == 1 and body["logprobs"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert local.samples_top_k
    with pytest.raises(ValidationError, match="speaks `tiergate`"):
        TierSpec(name="mid", backend="local", model="smollm2-135m-instruct", dialect="vllm", **PRICES)
    with pytest.raises(ValidationError):
        remote("sglang-nightly")  # not a dialect: refused by name, not guessed
