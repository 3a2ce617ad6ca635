"""The grammar cache (engine/grammar.py) remembers grammars and refusals per tenant: one tenant timing its own
`response_format` requests cannot learn which schemas another used lately (a cached grammar costs nothing, a compile a
millisecond or more, a remembered refusal answers at once), and its flood of schemas evicts only its own. Compiles are
counted by wrapping `GrammarCache._build`. At HEAD the cache was one LRU keyed by the schema alone: tenant B was
served tenant A's grammar and refusal without a compile, and A's flood evicted B's grammar."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine.grammar import GRAMMAR_TENANTS, GRAMMARS_PER_TENANT, GrammarCache
from engine.llm_engine import EngineInputError, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.fakes import CharTokenizer, ScriptedRunner, collect
from wire.response_format import ResponseFormat

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152
BAD = {"type": "strin"}  # llguidance refuses it


def fmt(schema: dict[str, Any]) -> ResponseFormat:
    spec = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    return SamplingParams(response_format=spec).output_format  # type: ignore[return-value]


def titled(title: str) -> ResponseFormat:
    return fmt({"type": "object", "title": title})


@pytest.fixture(scope="module")
def tokenizer(prepared_models: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared_models / "smollm2-135m-instruct")


def counted(cache: GrammarCache, monkeypatch: pytest.MonkeyPatch,
            meet: threading.Barrier | None = None) -> list[ResponseFormat]:
    """The formats `cache` builds from now on, one entry a compile (each first waiting at `meet` for the others)."""
    builds: list[ResponseFormat] = []
    build = cache._build

    def counting(f: ResponseFormat) -> Any:
        builds.append(f)
        if meet is not None:
            meet.wait()
        return build(f)
    monkeypatch.setattr(cache, "_build", counting)
    return builds


@pytest.mark.model
def test_another_tenants_request_for_a_schema_compiles_again(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    builds = counted(cache, monkeypatch)
    schema = titled("shared")
    mine = cache.compile(schema, "a")
    assert cache.known(schema, "b") is None and cache.known(schema, None) is None  # nothing to time: a miss
    theirs = cache.compile(schema, "b")
    assert len(builds) == 2 and theirs is not mine  # b paid its own compile
    assert cache.compile(schema, "a") is mine and cache.compile(schema, "b") is theirs and len(builds) == 2
    cache.compile(schema, None)  # no salt: an anonymous tenant of its own
    assert len(builds) == 3


@pytest.mark.model
def test_a_refusal_remembered_for_one_tenant_is_not_remembered_for_another(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    builds = counted(cache, monkeypatch)
    bad = fmt(BAD)
    with pytest.raises(EngineInputError, match="strin"):
        cache.compile(bad, "a")
    with pytest.raises(EngineInputError, match="strin"):
        cache.known(bad, "a")  # a's refusal, remembered: at once
    assert cache.known(bad, "b") is None  # not b's: it has never asked
    with pytest.raises(EngineInputError, match="strin") as caught:
        cache.compile(bad, "b")
    assert caught.value.param == "response_format" and len(builds) == 2  # b's refusal cost b a compile


@pytest.mark.model
def test_one_tenants_many_schemas_do_not_evict_anothers(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker compiles more schemas than the whole cache holds: the victim's grammar and refusal stay."""
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    grammar = cache.compile(titled("victim"), "victim")
    with pytest.raises(EngineInputError):
        cache.compile(fmt(BAD), "victim")
    for i in range(GRAMMARS_PER_TENANT * GRAMMAR_TENANTS + 1):
        cache.compile(titled(f"flood{i}"), "attacker")
    for i in range(GRAMMARS_PER_TENANT + 1):  # refusals of its own: `{"type": "strin", "title": ...}`
        with pytest.raises(EngineInputError):
            cache.compile(fmt(BAD | {"title": f"flood{i}"}), "attacker")
    builds = counted(cache, monkeypatch)
    assert cache.compile(titled("victim"), "victim") is grammar
    with pytest.raises(EngineInputError):
        cache.compile(fmt(BAD), "victim")
    assert not builds
    cache.compile(titled("flood0"), "attacker")  # the attacker's first, evicted by its own
    assert len(builds) == 1


@pytest.mark.model
def test_whole_tenants_are_evicted_least_recently_active_first(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bound: `per_tenant` grammars for each of the `tenants` most recently active tenants."""
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS], per_tenant=2, tenants=2)
    builds = counted(cache, monkeypatch)
    schema = titled("one")
    for tenant in ("a", "b", "a", "c"):  # a active again after b: c's memo takes b's place
        cache.compile(schema, tenant)
    assert len(builds) == 3
    cache.compile(schema, "a")
    assert len(builds) == 3
    cache.compile(schema, "b")
    assert len(builds) == 4


@pytest.mark.model
def test_one_tenants_concurrent_requests_for_a_new_schema_wait_for_one_compile(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads of tenant a at once: one compile; tenant b's, meanwhile, is its own and does not wait for a's
    (each compile waits until both have started: b waiting behind a's would break the barrier)."""
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    builds = counted(cache, monkeypatch, meet=threading.Barrier(2, timeout=5.0))
    schema = titled("burst")
    results: dict[str, list[object]] = {"a": [], "b": []}

    def request(tenant: str) -> None:
        results[tenant].append(cache.compile(schema, tenant))

    threads = [threading.Thread(target=request, args=(t,)) for t in ["a"] * 8 + ["b"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 2 and len(results["a"]) == 8 and len(results["b"]) == 1
    assert len({id(g) for g in results["a"]}) == 1 and results["b"][0] is not results["a"][0]


async def test_the_engine_caches_for_the_salts_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `generate`: a tenant's end users (`<tenant>.<user>` salts) share its grammars, another tenant compiles
    its own, and a refusal remembered for one tenant is not answered from memory to another (validate included)."""
    engine = LLMEngine(ScriptedRunner(), CharTokenizer())
    builds: list[ResponseFormat] = []

    def build(f: ResponseFormat) -> object:
        builds.append(f)
        if f.json_schema is not None and f.json_schema.schema_ == BAD:
            raise EngineInputError("response_format: the schema cannot be compiled: strin", param="response_format")
        return object()  # the scripted runner never masks with it
    monkeypatch.setattr(engine.grammars, "_build", build)
    monkeypatch.setattr(engine.grammars, "_vocab_size", 256)  # the character tokenizer has no length
    engine.start()
    try:
        for salt in ("a.alice", "a.bob", "b", None):
            params = SamplingParams(temperature=0.0, max_tokens=2, response_format=titled("shared"))
            _, last = await collect(engine.generate([65, 66], params, cache_salt=salt))
            assert last.error is None
        assert len(builds) == 3  # a (alice and bob), b, no salt
        for salt in ("a", "a", "b"):
            bad = SamplingParams(temperature=0.0, max_tokens=2, response_format=fmt(BAD))
            with pytest.raises(EngineInputError, match="strin"):
                await collect(engine.generate([65, 66], bad, cache_salt=salt))
        assert len(builds) == 5  # a's second refusal from memory, b's compiled
    finally:
        engine.shutdown()


@pytest.mark.model
def test_the_vocabulary_is_read_when_the_engine_starts_not_on_a_tenants_first_compile(tokenizer: Any) -> None:
    """Read on the first compile, it made that tenant wait for it and told a tenant timing its first compile whether
    anyone had compiled one since the engine started."""
    cache = GrammarCache(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])
    assert cache._lltok is None
    cache.warm()
    assert cache._lltok is not None
    eng = LLMEngine(ScriptedRunner(max_model_len=64), CharTokenizer())  # a tokenizer llguidance cannot read
    eng.grammars.warm()  # fails quietly: the first compile says why, to its own request
    assert eng.grammars._lltok is None
    warmed = threading.Event()
    eng.grammars.warm = warmed.set  # type: ignore[method-assign]
    eng.start()
    try:
        assert warmed.wait(timeout=10)  # the engine's start asked for it
    finally:
        eng.shutdown()
