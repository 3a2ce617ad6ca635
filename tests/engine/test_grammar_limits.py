"""A schema whose grammar runs past llguidance's limits is refused before requests run on it (engine/grammar.py).

An object of a thousand optional properties compiles, but its grammar fails after the answer's first token `{`
("Current row has 3999 items; max is 2000"). Each request with it was admitted, prefilled, given a first mask of 9 ms
on the step loop and failed with 400 `response_format_failed`: four threads of them tripled another tenant's p50
(tests/adversarial/test_hostile_tenant.py). Now a compile takes the first tokens a grammar allows one token further
(`_probe`) and refuses such a schema; one that fails later, mid-answer, is refused to that tenant from then on
(`ran_past_limits`), another tenant's requests untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest
import torch

from engine.grammar import GrammarCache, GrammarLimitError
from engine.llm_engine import EngineInputError, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, FaultyRunner, collect
from wire.response_format import ResponseFormat

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152
THOUSAND = {"type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
# fails at its tenth token, `{"name": "bob", "` reaching the key of the thousand properties' object
DEEP = {"type": "object", "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "a": THOUSAND}, "required": ["name", "a"]}


def fmt(schema: dict[str, Any]) -> ResponseFormat:
    spec = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    return SamplingParams(response_format=spec).output_format  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tokenizer(prepared_models: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared_models / "smollm2-135m-instruct")


@pytest.mark.model
def test_a_schema_whose_grammar_fails_at_the_second_token_is_refused_when_compiled(tokenizer: Any) -> None:
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    with pytest.raises(EngineInputError, match="second token") as refused:
        cache.compile(fmt(THOUSAND), "a")
    assert refused.value.param == "response_format"
    with pytest.raises(EngineInputError, match="second token"):
        cache.known(fmt(THOUSAND), "a")  # remembered: refused before a request runs
    assert cache.num_compiles == 0


@pytest.mark.model
def test_a_grammar_that_runs_past_its_limits_mid_answer_is_refused_to_its_tenant_after(tokenizer: Any) -> None:
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    deep = fmt(DEEP)
    matcher = cache.compile(deep, "a").matcher()  # the probe's two tokens do not reach the inner object
    logits = np.zeros(VOCAB, dtype=np.float32)
    with pytest.raises(GrammarLimitError) as failed:
        for token in tokenizer.encode('{"name": "bob", "a": {', add_special_tokens=False):
            masked = matcher.mask(torch.from_numpy(logits))
            assert masked[token] == 0  # the grammar allows the path, up to the inner object
            matcher.accept(token)
        matcher.mask(torch.from_numpy(logits))
    assert cache.known(deep, "a") is not None  # compiled and kept until an answer fails on it
    cache.ran_past_limits(cache.compile(deep, "a").key, "a", str(failed.value))
    with pytest.raises(EngineInputError, match="ran past its grammar's limits") as refused:
        cache.known(deep, "a")
    assert refused.value.param == "response_format"
    assert cache.known(deep, "b") is None  # another tenant's own compile decides for it


@pytest.mark.model
def test_the_first_mask_made_at_compile_is_the_one_each_copy_would_make(tokenizer: Any) -> None:
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    for schema in ({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
                   {"type": "string", "pattern": "^[a-c]{2,5}$"}, {"type": "array", "items": {"type": "integer"}}):
        compiled = cache.compile(fmt(schema), "a")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={
            "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False})
        unprobed = llguidance.LLMatcher(cache._llguidance_tokenizer(), grammar, log_level=0)
        ours, theirs = np.zeros((VOCAB + 31) // 32, dtype=np.int32), np.zeros((VOCAB + 31) // 32, dtype=np.int32)
        compiled.matcher()._matcher.unsafe_compute_mask_ptr(ours.ctypes.data, ours.nbytes)
        unprobed.unsafe_compute_mask_ptr(theirs.ctypes.data, theirs.nbytes)
        assert (ours == theirs).all() and ours.any()


async def test_the_engine_refuses_a_schema_its_tenant_saw_run_past_its_limits() -> None:
    """Through `generate`: the first request fails mid-answer (400 `response_format_failed`); the tenant's next
    request with that schema is refused before it runs, another tenant's runs."""
    engine = LLMEngine(FaultyRunner(), CharTokenizer())
    engine.grammars._build = lambda f: object()  # type: ignore[method-assign,assignment,return-value]
    engine.grammars._vocab_size = 256  # the character tokenizer has no length
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt(DEEP))
        _, last = await collect(engine.generate([ord(c) for c in "GRAMMAR-LIMIT"], params, cache_salt="a"))
        assert last.error_code == "response_format_failed"
        with pytest.raises(EngineInputError, match="ran past its grammar's limits"):
            await collect(engine.generate([65, 66], params, cache_salt="a"))
        _, other = await collect(engine.generate([65, 66], params, cache_salt="b"))
        assert other.error is None
    finally:
        engine.shutdown()
