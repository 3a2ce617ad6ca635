"""Structured output: `response_format` compiled to a grammar that masks the tokens a sequence may take next.

The library is llguidance (bench/structured_output.py compares it with xgrammar and outlines-core; BENCHMARKS.md,
"Structured output", has the figures and why): its JSON-schema compiler is bounded by design (fuel and size
limits: a 30-byte pattern that costs xgrammar 5 s of CPU compiles in 0.5 ms), it compiles a schema in about a
millisecond, and a token's mask and masking cost about 0.2 ms, under 2% of a decode token at 16 streams (our
engine's tokens/s measured the same with and without a schema).

- `GrammarCache`: compiles each format once per tenant and hands out `CompiledGrammar`s, keyed by the canonical JSON
  of its schema. A schema llguidance cannot compile is an EngineInputError (a 400) before anything streams, and is
  remembered: a compile can take seconds before it fails (an allOf of anyOfs of patterns, refused at the wire since,
  wire/schema_alternatives.py), and a repeat must not pay it again. What llguidance takes at once and pays for (or
  fails on) only when a sequence reaches it, a pattern repeating too much or a schema referring to itself in place,
  is refused at the wire before (wire/schema_costs.py). Grammars and refusals are remembered for the
  tenant that asked (the request's cache salt's, `salt_tenant`; a request with no salt is an anonymous tenant of its
  own), in an `OwnerMemo` each (assets/owner_memo.py): GRAMMARS_PER_TENANT a tenant, evicted by its own only, for
  the GRAMMAR_TENANTS most recently active tenants, so at most 16 x 16 = 256 grammars (the one shared cache's bound
  before) and as many refusals (a grammar holds 0.13 MiB for a 30-property schema, 0.4 MiB for a 200-property one:
  about 35-100 MiB at most). One cache shared by every tenant was a timing side channel: a hit costs nothing, a
  compile a millisecond or more, a remembered refusal answers at once, so a tenant timing its own `response_format`
  requests learnt which schemas another had used lately, and its flood of schemas evicted everyone's. Another
  tenant's schema is compiled again, at its cost. What is left is activity, not content: a tenant with 16 accounts
  of its own can tell whether any other tenant sent a `response_format` lately (it evicts its own probe's grammar);
  accepted, as the compile threads and the engine-wide queue bound show the same.
  Compiles run where the caller runs them: the engine looks a format up first (`known`) and runs `compile` on threads
  of its own, shared fairly between tenants with a bounded queue (engine/compile_queue.py), off its step loop, the
  event loop and the event loop's default executor; a tenant's concurrent requests for one new schema wait for one
  compile (another tenant's never wait for it). A grammar that fails later, mid-answer (an object of a thousand
  optional properties: "max_items_in_row" at its second token), fails its sequence alone with
  `response_format_failed`, the request's own error (engine/model_runner.py), which the gateway never counts against
  the replica's health; the tenant's later requests with that schema are refused at once (`ran_past_limits`), and a
  compile already takes the first PROBE_TOKENS tokens a grammar allows one token further (`_probe`), refusing one
  that fails there before any request runs on it: four threads of such requests had tripled another tenant's p50
  (0.16 -> 0.50 s, bench.hostile_tenant).
- `GrammarMatcher`: one sequence's place in its grammar. The sampler (engine/sampler.py) asks it for the logits
  with every token the grammar refuses at -inf (EOS included until the answer is complete) and tells it each
  token chosen.

Answers are compact-ish JSON: no free whitespace, ", " between items and ": " after keys (a small model left
free whitespace can spend its whole budget on newlines). Tool calling uses the same path: a "required" or named
tool_choice becomes a json_schema format of the call (engine/tool_calls.py), compiled and cached like any other.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from assets.owner_memo import OwnerMemo
from engine.sampling_params import EngineInputError
from wire.response_format import ResponseFormat

log = logging.getLogger("tiergate.engine.grammar")
GRAMMARS_PER_TENANT = 16  # grammars (and as many refusals) remembered for one tenant
GRAMMAR_TENANTS = 16  # tenants whose grammars are remembered, the most recently active
# A compile takes this many of the tokens a grammar allows first (the lowest ids) one token further, and refuses a
# grammar that runs past its limits there: an object of a thousand optional properties allows `{`, `{}` and `{"`
# first and fails after `{` ("Current row has 3999 items; max is 2000"), which cost a prefill, a step-loop mask of
# 9 ms and a 400 each time it was asked (measured 2026-12-06)
PROBE_TOKENS = 8
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# our separators, over any `x-guidance` options a schema carries (wire refuses them by name; a format built without
# its validation keeps ours)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(RuntimeError):
    """A sequence's grammar refused the token it was given, or ran past its limits; the sequence fails alone."""


class GrammarLimitError(GrammarError):
    """A sequence's grammar ran past llguidance's limits (the schema's, not the sampler's fault): the tenant's later
    requests with that schema are refused before they run (`GrammarCache.ran_past_limits`)."""


Tenant = str | None  # a request's cache salt's tenant (engine/sequence.py, `salt_tenant`); None: no salt


def grammar_key(fmt: ResponseFormat) -> str:
    """What the cache keys on: the kind, strictness and canonical JSON of the schema (not its name)."""
    if fmt.json_schema is None:
        return "json_object"
    schema = json.dumps(fmt.json_schema.schema_, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"json_schema:{'strict' if fmt.json_schema.strict else 'lenient'}:{schema}"


class GrammarMatcher:
    """One sequence's state in its grammar; used by the engine loop's thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # bit j of word w: token 32w + j allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar does not allow next at -inf (a new tensor)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._matcher.is_error():
            raise GrammarLimitError(f"the response_format grammar failed: {self._matcher.get_error()}")
        # the refused tokens' bits, one byte each: [V] bool
        refused = np.unpackbits((~self._words).view(np.uint8), bitorder="little")[:self._vocab_size].view(np.bool_)
        return logits.masked_fill(torch.from_numpy(refused), float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance by the token chosen (one `mask` allowed)."""
        if not self._matcher.consume_token(token_id):
            # the mask allowed it, so the grammar ran past its limits taking it (the mask is made lazily)
            raise GrammarLimitError(f"the response_format grammar refused token {token_id}: "
                                    f"{self._matcher.get_error()}")


@dataclass(frozen=True)
class CompiledGrammar:
    """A format compiled for this engine's tokenizer: a pristine matcher that each request copies."""

    key: str
    pristine: llguidance.LLMatcher
    vocab_size: int

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.pristine.deep_copy(), self.vocab_size)


class GrammarCache:
    """Compiles response formats for one tokenizer, once each per tenant; thread-safe."""

    def __init__(self, tokenizer: Any, *, vocab_size: int | None, eos_token_ids: list[int],
                 per_tenant: int = GRAMMARS_PER_TENANT, tenants: int = GRAMMAR_TENANTS) -> None:
        """`vocab_size`: the model's logits' width [default: the tokenizer's length]. `per_tenant`, `tenants`: the
        grammars (and refusals) remembered for one tenant, and for how many tenants."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._grammars: OwnerMemo[CompiledGrammar] = OwnerMemo(per_tenant, tenants)  # (tenant, key) -> its grammar
        self._refused: OwnerMemo[str] = OwnerMemo(per_tenant, tenants)  # (tenant, key) -> why it cannot be compiled
        self._compiling: dict[tuple[Tenant, str], threading.Lock] = {}  # held while one thread compiles it
        self._lltok: llguidance.LLTokenizer | None = None
        self._lltok_lock = threading.Lock()
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self.num_compiles = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size if self._vocab_size is not None else len(self._tokenizer)

    def known(self, fmt: ResponseFormat, tenant: Tenant) -> CompiledGrammar | None:
        """The compiled grammar of a format `tenant` compiled before, None for one it never compiled (whoever else
        did); EngineInputError for one refused to it before. Never compiles."""
        key = grammar_key(fmt)
        with self._lock:
            return self._known(tenant, key)

    def compile(self, fmt: ResponseFormat, tenant: Tenant) -> CompiledGrammar:
        """The compiled grammar of `fmt` (json_object or json_schema) for `tenant`, compiling it on a miss;
        EngineInputError naming `response_format` for a schema that cannot be compiled."""
        key = grammar_key(fmt)
        with self._lock:
            if (hit := self._known(tenant, key)) is not None:
                return hit
            gate = self._compiling.setdefault((tenant, key), threading.Lock())
        with gate:
            try:
                with self._lock:
                    if (hit := self._known(tenant, key)) is not None:  # compiled while this thread waited
                        return hit
                try:
                    compiled = CompiledGrammar(key, self._build(fmt), self.vocab_size)
                except EngineInputError as exc:
                    with self._lock:
                        self._refused.put(tenant, key, str(exc))
                    raise
                with self._lock:
                    self.num_compiles += 1
                    self._grammars.put(tenant, key, compiled)
                return compiled
            finally:
                with self._lock:  # not a gate a later thread made after this one's was taken out
                    if self._compiling.get((tenant, key)) is gate:
                        del self._compiling[(tenant, key)]

    def _known(self, tenant: Tenant, key: str) -> CompiledGrammar | None:
        """Under the lock: the tenant's grammar of `key`, or None; a format refused to it before is refused again at
        once."""
        if (hit := self._grammars.get(tenant, key)) is not None:
            return hit
        if (why := self._refused.get(tenant, key)) is not None:
            raise EngineInputError(why, param="response_format")
        return None

    def _build(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        spec = fmt.json_schema
        schema = ANY_JSON_OBJECT if spec is None else spec.schema_
        options = JSON_OPTIONS | {"lenient": not (spec and spec.strict)}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise EngineInputError(f"response_format: the schema cannot be compiled: {exc}",
                                   param="response_format") from None
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, limits=self._limits, log_level=0)
        if matcher.is_error():
            raise EngineInputError(f"response_format: the schema cannot be enforced: {matcher.get_error()}",
                                   param="response_format")
        self._probe(matcher)
        return matcher

    def _probe(self, pristine: llguidance.LLMatcher) -> None:
        """Compute the grammar's first mask here, on the compiling thread, and take each of the first PROBE_TOKENS
        tokens it allows one token further; EngineInputError for a grammar that runs past its limits on the way.
        The pristine matcher keeps its first mask, so each request's copy finds it made: the first token's mask
        costs the step loop ~0.07 ms instead of what it costs to make (9 ms for a thousand optional properties)."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        pristine.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if pristine.is_error():
            raise EngineInputError(f"response_format: the schema cannot be enforced: {pristine.get_error()}",
                                   param="response_format")
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size]
        for token in np.flatnonzero(allowed)[:PROBE_TOKENS].tolist():
            after = pristine.deep_copy()
            if after.consume_token(token):
                after.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            if after.is_error():
                raise EngineInputError(f"response_format: the schema cannot be enforced: its grammar runs past its "
                                       f"limits at the answer's second token ({after.get_error()})",
                                       param="response_format")

    def ran_past_limits(self, key: str, tenant: Tenant, why: str) -> None:
        """A sequence of `tenant`'s with the grammar of `key` (`CompiledGrammar.key`) failed mid-answer on its limits
        (GrammarLimitError): its later requests with that format are refused before they run (`known`), as a schema
        that cannot be compiled is, not each given a prefill, the step loop's masks and the same 400."""
        with self._lock:
            self._grammars.pop(tenant, key)
            self._refused.put(tenant, key, f"response_format: the schema cannot be enforced: an answer ran past its "
                                           f"grammar's limits ({why.removeprefix('GrammarLimitError: ')})")

    def warm(self) -> None:
        """Build llguidance's view of the vocabulary now (0.24 s and 9 MiB for SmolLM2's 49,152 tokens, measured
        2026-12-06), not on the first compile: built there, the first tenant to send a `response_format` waited for
        it, and any tenant timing its first compile learnt whether anyone had compiled one since the engine
        started. The engine calls it on a thread of its own at start; a tokenizer llguidance cannot read fails here
        quietly and again, as before, at the first compile."""
        try:
            self._llguidance_tokenizer()
        except Exception as exc:  # the first compile reports it to its request
            log.debug("grammar: llguidance's tokenizer not built ahead: %r", exc)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """Built once: ahead by `warm`, or on the first compile if that comes first."""
        with self._lltok_lock:
            if self._lltok is None:
                text = self._tokenizer.backend_tokenizer.to_str()  # the fast tokenizer's JSON, added tokens included
                self._lltok = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
            return self._lltok
