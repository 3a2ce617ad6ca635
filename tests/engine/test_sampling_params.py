"""The engine checks every sampling parameter itself, for callers that do not come through the HTTP server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.llm_engine import EngineInputError, LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from wire.chat_request import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MIN_TEMPERATURE

BAD = [
    ("seed", {"seed": MAX_SEED + 1}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 1.5}),
    ("temperature", {"temperature": 1e-40}),
    ("temperature", {"temperature": MIN_TEMPERATURE / 2}),
    ("temperature", {"temperature": 2.5}),
    ("temperature", {"temperature": -1.0}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": float("inf")}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": float("nan")}),
    ("top_k", {"top_k": -2}),
    ("max_tokens", {"max_tokens": 0}),
    ("stop", {"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)}),
    ("stop", {"stop": ["x" * (MAX_STOP_CHARS + 1)]}),
    ("stop", {"stop": [""]}),  # was dropped unsaid (the detokenizer skips it); vLLM refuses it
    ("stop", {"stop": ["x", ""]}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -3}),
    ("presence_penalty", {"presence_penalty": "0.5"}),
    ("presence_penalty", {"presence_penalty": True}),
    ("presence_penalty", {"presence_penalty": float("nan")}),
    ("frequency_penalty", {"frequency_penalty": 2.0000001}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": "1"}),
    ("frequency_penalty", {"frequency_penalty": False}),
    ("frequency_penalty", {"frequency_penalty": float("-inf")}),
]


@pytest.mark.parametrize(("param", "fields"), BAD, ids=[f"{p}={v}" for p, f in BAD for v in f.values()])
def test_a_bad_parameter_is_refused_naming_it(param: str, fields: dict[str, Any]) -> None:
    with pytest.raises(EngineInputError) as err:
        SamplingParams(**fields)
    assert err.value.param == param and param in str(err.value)


def test_the_bounds_themselves_are_accepted() -> None:
    for fields in ({"seed": 0}, {"seed": MAX_SEED}, {"seed": 2**63}, {"temperature": 0}, {"temperature": 2.0},
                   {"temperature": MIN_TEMPERATURE}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"max_tokens": 1},
                   {"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES}, {"logprobs": 0}, {"logprobs": 20},
                   {"presence_penalty": -2.0}, {"presence_penalty": 2}, {"frequency_penalty": -2},
                   {"frequency_penalty": 2.0}):
        SamplingParams(**fields)


async def test_a_direct_caller_of_generate_is_refused_even_after_changing_the_params() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer())
    eng.start()
    try:
        params = SamplingParams(temperature=1.0, seed=1)
        params.seed = 2**64  # a dataclass can be changed after it was checked
        with pytest.raises(EngineInputError) as err:
            await anext(eng.generate([1, 2], params))
        assert err.value.param == "seed" and eng.dead_reason is None
    finally:
        eng.shutdown()


async def test_prompt_ids_outside_the_models_vocabulary_are_refused(tiny_llama: Path) -> None:
    eng = LLMEngine(ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20), CharTokenizer())
    for prompt in ([1, 256], [-1, 2]):  # the tiny model has 256 embeddings
        with pytest.raises(EngineInputError) as err:
            await anext(eng.generate(prompt, SamplingParams(max_tokens=4)))
        assert err.value.param == "prompt_token_ids"
