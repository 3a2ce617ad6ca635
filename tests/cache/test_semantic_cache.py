"""The facade with the real MiniLM embedder: scopes never cross, near misses miss, paraphrases hit, sampling
parameters sent alike are one scope. What becomes of stored entries: test_semantic_cache_lifecycle.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cache import Embedder, Hit, SemanticCache, SQLiteStore, TenantPolicy, guards
from cache.semantic_cache import SEMANTIC_MAX_CHARS
from tests.cache.conftest import FakeClock, chat, scope
from tests.text_reads import TextReads

Q = "How do I convert 5 km to miles?"
PARAPHRASE = "How can I convert 5 kilometers into miles?"


def _stored(cache: SemanticCache, body: dict | None = None, **scope_args: object) -> None:
    body = body or chat(Q)
    assert cache.store(scope(body, **scope_args), body, "3.1 miles", {"total_tokens": 12}) is not None


def test_exact_then_semantic_hit(cache: SemanticCache) -> None:
    _stored(cache)
    exact = cache.lookup(scope(chat(Q)), chat(Q))
    assert isinstance(exact, Hit) and exact.kind == "exact" and exact.response == "3.1 miles"
    assert exact.usage == {"total_tokens": 12}
    assert exact.headers() == {"x-tiergate-cache": "hit", "x-tiergate-cache-kind": "exact"}
    para = cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))
    assert isinstance(para, Hit) and para.kind == "semantic"
    assert TenantPolicy().similarity_threshold <= para.similarity < 1.0
    assert para.headers()["x-tiergate-cache-similarity"].startswith("0.")


@pytest.mark.parametrize("other", [
    {"tenant": "globex"},
    {"roles": ["admin"]},
    {"end_user": "alice"},
    {"data_version": 2},
    {"model_version": "m2"},
], ids=["tenant", "identity-roles", "identity-end-user", "data-version", "model-version"])
def test_a_hit_never_crosses_scope(cache: SemanticCache, other: dict) -> None:
    _stored(cache)
    for question in (Q, PARAPHRASE):
        result = cache.lookup(scope(chat(question), **other), chat(question))
        assert result.status == "miss", (other, question)
    assert cache.lookup(scope(chat(Q)), chat(Q)).status == "hit"  # the original scope still hits


def test_a_hit_never_crosses_system_prompt(cache: SemanticCache) -> None:
    _stored(cache)
    pirate = chat(Q, system="Answer like a pirate.")
    assert cache.lookup(scope(pirate), pirate).status == "miss"
    assert cache.lookup(scope(chat(PARAPHRASE, system="Answer like a pirate.")),
                        chat(PARAPHRASE, system="Answer like a pirate.")).status == "miss"


def test_end_user_isolation_keeps_users_apart(cache: SemanticCache) -> None:
    _stored(cache, end_user="alice")
    assert cache.lookup(scope(chat(Q), end_user="alice"), chat(Q)).status == "hit"
    assert cache.lookup(scope(chat(Q), end_user="bob"), chat(Q)).status == "miss"


@pytest.mark.parametrize(("stored", "query"), [
    ("How do I convert 5 km to miles?", "How do I convert 7 km to miles?"),
    ("How do I convert 5 km to miles?", "How do I convert 5.5 km to miles?"),
    ("How do I convert 5 km to miles?", "How do I convert 5 miles to km?"),
    ("Why is my Python code slow?", "Why is my Python code not slow?"),
    ("Can I take ibuprofen with alcohol?", "Can I take ibuprofen without alcohol?"),
    ("Is Paris bigger than London?", "Is London bigger than Paris?"),
    ("What is the population of France?", "What is the population of Germany?"),
    ("Which is faster, Python or Java?", "Which is slower, Python or Java?"),
])
def test_near_misses_miss(cache: SemanticCache, stored: str, query: str) -> None:
    _stored(cache, chat(stored))
    result = cache.lookup(scope(chat(query)), chat(query))
    assert result.status == "miss", result
    if result.best_similarity is not None and result.best_similarity >= TenantPolicy().similarity_threshold:
        assert result.reason.startswith("refused near miss"), result.reason  # the guards, not the threshold


def test_guards_refuse_what_plain_cosine_would_serve(cache: SemanticCache) -> None:
    _stored(cache)
    result = cache.lookup(scope(chat("How do I convert 7 km to miles?")), chat("How do I convert 7 km to miles?"))
    assert result.status == "miss" and result.best_similarity > 0.85
    assert result.reason.startswith("refused near miss: numbers differ")
    assert cache.stats.refused == {"numbers differ": 1}


@pytest.mark.parametrize(("stored", "query"), [
    ("What is the capital of France?", "Tell me the capital city of France."),
    ("How do I reverse a list in Python?", "how do i reverse a list in python"),
    ("What are the health benefits of green tea?", "What health benefits does green tea have?"),
])
def test_paraphrases_hit(cache: SemanticCache, stored: str, query: str) -> None:
    _stored(cache, chat(stored))
    result = cache.lookup(scope(chat(query)), chat(query))
    assert isinstance(result, Hit) and result.kind == "semantic", result


def test_follow_ups_only_hit_with_the_same_history(cache: SemanticCache) -> None:
    paris = [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": "20 C"}]
    rome = [{"role": "user", "content": "What is the weather in Rome?"}, {"role": "assistant", "content": "20 C"}]
    _stored(cache, chat("And tomorrow?", history=paris))
    assert cache.lookup(scope(chat("And tomorrow?", history=rome)), chat("And tomorrow?", history=rome)).status \
        == "miss"
    what_about = chat("and tomorrow?", history=paris)
    assert cache.lookup(scope(what_about), what_about).status == "hit"


def test_no_cache_skips_lookup_and_no_store_skips_storing(cache: SemanticCache) -> None:
    body = chat(Q)
    assert cache.store(scope(body), body, "a", headers={"Cache-Control": "no-store"}) is None
    assert cache.lookup(scope(body), body).status == "miss"
    _stored(cache)
    skipped = cache.lookup(scope(body), body, headers={"Cache-Control": "no-cache"})
    assert skipped.status == "bypass" and "no-cache" in skipped.reason
    assert skipped.headers() == {"x-tiergate-cache": "bypass"}
    assert cache.lookup(scope(body), body, headers={"Cache-Control": "no-store"}).status == "hit"


def test_nondeterministic_requests_bypass(cache: SemanticCache) -> None:
    hot = chat(Q, temperature=0.8)
    assert cache.store(scope(hot), hot, "a") is None
    assert cache.lookup(scope(hot), hot).reason == "bypass: temperature>0 without seed"
    seeded = chat(Q, temperature=0.8, seed=42)
    cache.store(scope(seeded), seeded, "seeded answer")
    assert cache.lookup(scope(seeded), seeded).status == "hit"
    other_seed = chat(Q, temperature=0.8, seed=43)
    assert cache.lookup(scope(other_seed), other_seed).status == "miss"


@pytest.mark.parametrize("penalties", [{"frequency_penalty": 0.5}, {"presence_penalty": 0.5},
                                       {"frequency_penalty": -1.0, "presence_penalty": 2.0}])
def test_a_hit_never_crosses_penalties(cache: SemanticCache, penalties: dict) -> None:
    """An answer made under other presence or frequency penalties (none, or other values) is another answer."""
    _stored(cache)
    for question in (Q, PARAPHRASE):
        asked = chat(question, **penalties)
        assert cache.lookup(scope(asked), asked).status == "miss", (penalties, question)
    _stored(cache, chat(Q, **penalties))
    assert cache.lookup(scope(chat(PARAPHRASE, **penalties)), chat(PARAPHRASE, **penalties)).status == "hit"
    other = chat(PARAPHRASE, frequency_penalty=1.5)
    assert cache.lookup(scope(other), other).status == "miss"


@pytest.mark.parametrize("zero", [{"presence_penalty": 0}, {"frequency_penalty": 0.0},
                                  {"presence_penalty": -0.0, "frequency_penalty": 0}])
def test_a_zero_penalty_is_no_penalty(cache: SemanticCache, zero: dict) -> None:
    """A zero penalty is what every server does without one, and the tier gets no penalty field for it
    (upstream_body): the same request as one leaving the fields out, and the same key, both ways."""
    _stored(cache)
    asked = chat(Q, **zero)
    hit = cache.lookup(scope(asked), asked)
    assert isinstance(hit, Hit) and hit.kind == "exact" and hit.response == "3.1 miles", zero
    _stored(cache, chat(PARAPHRASE, **zero))
    hit = cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))
    assert isinstance(hit, Hit) and hit.kind == "exact", zero
    for field in zero:  # a penalty that is not zero is still another answer
        other = chat(Q, **{**zero, field: 0.5})
        assert cache.lookup(scope(other), other).status == "miss", (zero, field)


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_off_is_no_top_k(cache: SemanticCache, off: int) -> None:
    """A seeded sample's `top_k` of -1 or 0 is off: the tier gets no top_k for it (upstream_body), so it is the
    request without one. A `top_k` above 0 samples otherwise."""
    seeded = chat(Q, temperature=0.8, seed=42)
    cache.store(scope(seeded), seeded, "seeded answer")
    asked = chat(Q, temperature=0.8, seed=42, top_k=off)
    hit = cache.lookup(scope(asked), asked)
    assert isinstance(hit, Hit) and hit.kind == "exact" and hit.response == "seeded answer"
    sampled = chat(Q, temperature=0.8, seed=42, top_k=5)
    assert cache.lookup(scope(sampled), sampled).status == "miss"


def _seeded(question: str, **sent: object) -> dict:
    """A request seeded 42 with the sampling parameters `sent` and no others (chat() sends temperature 0)."""
    body = chat(question, seed=42, **sent)
    if "temperature" not in sent:
        del body["temperature"]
    return body


SENT_OTHERWISE = {  # (stored, asked): what the tier is sent differs
    "t-absent-vs-1": ({}, {"temperature": 1.0}), "t-1-vs-absent": ({"temperature": 1.0}, {}),
    "p-absent-vs-1": ({}, {"top_p": 1.0}), "p-1-vs-absent": ({"top_p": 1.0}, {}),
    "p-absent-vs-1-with-t": ({"temperature": 1.0}, {"temperature": 1.0, "top_p": 1.0}),
    "p-absent-vs-int-1": ({"temperature": 0.8}, {"temperature": 0.8, "top_p": 1}),
}
SENT_ALIKE = {  # (stored, asked): the tier is sent the same request
    "absent": ({}, {}), "null-is-absent": ({}, {"temperature": None, "top_p": None}),
    "int-is-float": ({"temperature": 1, "top_p": 1}, {"temperature": 1.0, "top_p": 1.0}),
    "same-values": ({"temperature": 0.8, "top_p": 0.5}, {"temperature": 0.8, "top_p": 0.5}),
}


@pytest.mark.parametrize(("stored", "asked"), SENT_OTHERWISE.values(), ids=SENT_OTHERWISE.keys())
def test_a_seeded_sample_without_temperature_or_top_p_is_not_one_with_1(cache: SemanticCache, stored: dict,
                                                                        asked: dict) -> None:
    """The tier gets no temperature or top_p where the request sends none (upstream_body) and samples with its own
    default then (llama.cpp's server 0.8 and 0.95, vLLM the model's generation_config), so an answer sampled so is
    no answer to a request that sends 1.0, nor the reverse, exactly or by meaning."""
    cache.store(scope(_seeded(Q, **stored)), _seeded(Q, **stored), "seeded answer")
    for question in (Q, PARAPHRASE):
        body = _seeded(question, **asked)
        assert cache.lookup(scope(body), body).status == "miss", (stored, asked, question)
    hit = cache.lookup(scope(_seeded(Q, **stored)), _seeded(Q, **stored))  # what is sent alike still hits
    assert isinstance(hit, Hit) and hit.kind == "exact" and hit.response == "seeded answer"


@pytest.mark.parametrize(("stored", "asked"), SENT_ALIKE.values(), ids=SENT_ALIKE.keys())
def test_seeded_samples_sent_alike_hit(cache: SemanticCache, stored: dict, asked: dict) -> None:
    """A null is not sent (upstream_body drops it) and 1 is the JSON number 1.0: the tier gets the same request."""
    cache.store(scope(_seeded(Q, **stored)), _seeded(Q, **stored), "seeded answer")
    hit = cache.lookup(scope(_seeded(Q, **asked)), _seeded(Q, **asked))
    assert isinstance(hit, Hit) and hit.kind == "exact" and hit.response == "seeded answer", (stored, asked)


@pytest.mark.parametrize("zero", [0, 0.0, -0.0])
def test_temperature_0_is_greedy_whatever_else_is_sent(cache: SemanticCache, zero: float) -> None:
    _stored(cache)  # temperature 0, nothing else
    for asked in (chat(Q, temperature=zero), chat(Q, temperature=zero, seed=42, top_p=0.5, top_k=5)):
        hit = cache.lookup(scope(asked), asked)
        assert isinstance(hit, Hit) and hit.kind == "exact" and hit.response == "3.1 miles", asked


def test_seeded_entries_of_the_old_form_are_never_found(cache: SemanticCache) -> None:
    """The old form read an absent temperature and top_p as 1.0: an answer a request without them stored (sampled
    at the tier's defaults) is not found by one that sends 1.0."""
    stored_so = replace(scope(_seeded(Q)), sampling_class="seed:42:t=1.0:p=1.0:k=None")
    assert cache.store(stored_so, _seeded(Q), "sampled at the tier's defaults") is not None
    for question in (Q, PARAPHRASE):
        asked = _seeded(question, temperature=1.0, top_p=1.0)
        assert cache.lookup(scope(asked), asked).status == "miss", question


def test_tenant_policy_opt_out_threshold_and_exact_only(cache: SemanticCache) -> None:
    _stored(cache)
    para = chat(PARAPHRASE)
    assert cache.lookup(scope(para), para, policy=TenantPolicy(enabled=False)).reason == "bypass: tenant opted out"
    assert cache.lookup(scope(para), para, policy=TenantPolicy(semantic=False)).status == "miss"
    strict = cache.lookup(scope(para), para, policy=TenantPolicy(similarity_threshold=0.999))
    assert strict.status == "miss" and strict.reason.startswith("below threshold")
    assert cache.store(scope(para), para, "x", policy=TenantPolicy(enabled=False)) is None


def test_long_last_turns_are_exact_only(cache: SemanticCache) -> None:
    long_q = "Please review this text. " + "The quick brown fox jumps over the lazy dog. " * 40
    cache.store(scope(chat(long_q)), chat(long_q), "ok")
    changed = long_q + " Also check grammar."
    assert cache.lookup(scope(chat(long_q)), chat(long_q)).status == "hit"
    assert cache.lookup(scope(chat(changed)), chat(changed)).reason == "no entry"


async def test_async_wrappers(cache: SemanticCache) -> None:
    body = chat(Q)
    assert await cache.astore(scope(body), body, "a") is not None
    result = await cache.alookup(scope(body), body)
    assert result.status == "hit"


def test_concurrent_lookups_and_stores_stay_consistent(cache: SemanticCache) -> None:
    from concurrent.futures import ThreadPoolExecutor

    questions = [f"What is {n} plus {n}?" for n in range(12)]

    def work(q: str) -> tuple[str, str]:
        body = chat(q)
        cache.store(scope(body), body, f"answer to {q}")
        result = cache.lookup(scope(body), body)
        return q, result.response if isinstance(result, Hit) else ""

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(work, questions))
    assert all(answer == f"answer to {q}" for q, answer in results)
    assert len(cache.entries) == len(cache.index) == len(questions)
    other = chat("What is 5 plus 7?")  # numbers differ from every stored question
    assert cache.lookup(scope(other), other).status == "miss"


class _TableEmbedder(Embedder):
    """Fixed vectors per text, so similarities in a test are exact and chosen by hand."""

    def __init__(self, table: dict[str, list[float]]):
        super().__init__(num_threads=None)
        self.dim = 3
        self.table = {k: np.asarray(v, dtype=np.float32) / np.linalg.norm(v) for k, v in table.items()}

    @property
    def max_tokens(self) -> int:
        return 256

    def encode(self, texts, *, batch_size: int = 64) -> np.ndarray:  # type: ignore[no-untyped-def]
        return np.stack([self.table[t] for t in texts])


def test_farther_candidates_are_tried_only_within_the_margin(clock: FakeClock) -> None:
    query, refused, close, far = ("Convert 5 km to miles", "Convert 7 km to miles", "Turn 5 km into miles",
                                  "Convert 5 km into miles please")
    table = {query: [1, 0, 0], refused: [1, 0.05, 0], close: [1, 0.12, 0], far: [1, 0.5, 0]}
    cache = SemanticCache(SQLiteStore(), _TableEmbedder(table), clock=clock, fallback_margin=0.02)
    for text in (refused, far):
        cache.store(scope(chat(text)), chat(text), text)
    result = cache.lookup(scope(chat(query)), chat(query), policy=TenantPolicy(similarity_threshold=0.8))
    assert result.status == "miss" and "numbers differ" in result.reason  # far (0.89) is beyond the margin
    cache.store(scope(chat(close)), chat(close), close)
    result = cache.lookup(scope(chat(query)), chat(query), policy=TenantPolicy(similarity_threshold=0.8))
    assert isinstance(result, Hit) and result.response == close  # 0.993, within 0.02 of the refused 0.999


class _RecordingEmbedder(Embedder):
    """The real embedder, remembering the longest text it was handed to embed or to count."""

    def __init__(self, inner: Embedder):
        super().__init__(num_threads=None)
        self.inner, self.longest = inner, 0

    @property
    def max_tokens(self) -> int:
        return self.inner.max_tokens

    def num_tokens(self, text: str) -> int:
        self.longest = max(self.longest, len(text))
        return self.inner.num_tokens(text)

    def encode(self, texts, *, batch_size: int = 64) -> np.ndarray:  # type: ignore[no-untyped-def]
        self.longest = max([self.longest, *map(len, texts)])
        return self.inner.encode(texts, batch_size=batch_size)


def test_turns_too_long_to_compare_whole_are_exact_only_and_never_embedded(embedder: Embedder, clock: FakeClock,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What such a turn costs is counted, not timed: neither the embedder nor any of the guards' scans is handed
    more than SEMANTIC_MAX_CHARS of it (its exact key reads it whole, as it must)."""
    recording = _RecordingEmbedder(embedder)
    reads = TextReads.watch(monkeypatch, guards)
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=100), recording, clock=clock)
    cached = "1" * 150  # one "word" the tokenizer reads as [UNK]: a few word pieces, so it is embedded
    assert cache.store(scope(chat(cached)), chat(cached), "a number") is not None
    assert len(cache.index) == 1
    # over SEMANTIC_MAX_CHARS, though each is a few word pieces too: the guards would not read them whole
    for attack in ("1" * 20_000, "1" * 200_000, "x" + "1" * SEMANTIC_MAX_CHARS):
        result = cache.lookup(scope(chat(attack)), chat(attack))
        assert result.status == "miss" and "too long" in result.reason
        stored = cache.store(scope(chat(attack)), chat(attack), "stored for exact hits")
        assert stored is not None and stored.semantic_text == ""  # nothing kept that only the guards would read
        hit = cache.lookup(scope(chat(attack)), chat(attack))
        assert isinstance(hit, Hit) and hit.kind == "exact"
    assert recording.longest <= SEMANTIC_MAX_CHARS and len(cache.index) == 1
    assert reads.longest <= SEMANTIC_MAX_CHARS, reads.by
