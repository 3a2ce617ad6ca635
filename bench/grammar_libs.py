"""The grammar libraries bench/structured_output.py compares, behind one small interface (`Lib`).

llguidance is the engine's (engine/grammar.py); xgrammar and outlines-core are installed only to be compared
(see bench/structured_output.py). Each adapter is built for one tokenizer and imports its library when called,
so a library not installed fails only its own adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SEPARATORS = (", ", ": ")  # what the engine's grammars allow between items and after keys (engine/grammar.py)


@dataclass
class Lib:
    name: str
    compile: Callable[[dict[str, Any] | None], Any]  # schema (None: any JSON object) -> compiled grammar
    matcher: Callable[[Any], Any]  # compiled -> a fresh matcher, as a new request gets one
    fill: Callable[[list[Any], Any], None]  # (matchers, bitmask [k, W] int32): row i for matcher i
    accept: Callable[[Any, int], Any]


def llguidance_lib(tok: Any, vocab: int, eos: int, *, batched: bool = False) -> Lib:
    import llguidance
    import llguidance.torch as llt

    from engine.grammar import JSON_OPTIONS

    lltok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=[eos])
    executor = llguidance.LLExecutor()
    limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile_(schema: dict[str, Any] | None) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"},
                                                               overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        pristine = llguidance.LLMatcher(lltok, grammar, limits=limits, log_level=0)  # builds the lexer
        assert not pristine.is_error(), pristine.get_error()
        return pristine

    def fill(ms: list[Any], bitmask: Any) -> None:
        if batched:
            llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bitmask)
        else:
            for i, m in enumerate(ms):
                llt.fill_next_token_bitmask(m, bitmask, i)

    return Lib("llguidance" + (" (batched)" if batched else ""), compile_, lambda p: p.deep_copy(), fill,
               lambda m, t: m.consume_token(t))


def xgrammar_lib(tok: Any, vocab: int, eos: int, *, batched: bool = False) -> Lib:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    batch = xgr.BatchGrammarMatcher() if batched else None

    def compile_(schema: dict[str, Any] | None) -> Any:
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)

    def fill(ms: list[Any], bitmask: Any) -> None:
        if batch is not None:
            batch.batch_fill_next_token_bitmask(ms, bitmask)
        else:
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(bitmask, i)

    return Lib("xgrammar" + (" (batched)" if batched else ""), compile_, xgr.GrammarMatcher, fill,
               lambda m, t: m.accept_token(t))


def outlines_lib(tok: Any, vocab: int, eos: int, *, batched: bool = False) -> Lib:
    import outlines_core as oc
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {v: k for k, v in bytes_to_unicode().items()}  # GPT-2's byte alphabet: how SmolLM2 spells bytes
    special = set(tok.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for token, i in tok.get_vocab().items():
        if i not in special and i < vocab:
            tokens.setdefault(bytes(decoder[c] for c in token), []).append(i)
    vocabulary = oc.Vocabulary(eos, tokens)

    def compile_(schema: dict[str, Any] | None) -> Any:
        # whitespace: an optional space wherever JSON allows it (its regex builder has no separator option)
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}), r"[ ]?")
        return oc.Index(regex, vocabulary)

    def fill(ms: list[Any], bitmask: Any) -> None:
        for i, m in enumerate(ms):
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(m: Any, token: int) -> None:
        if token != eos:  # EOS ends the answer: a final state has no move for it (and allows it)
            m.advance(token)

    return Lib("outlines-core", compile_, oc.Guide, fill, accept)


LIBRARIES: dict[str, Callable[..., Lib]] = {"llguidance": llguidance_lib, "xgrammar": xgrammar_lib,
                                            "outlines-core": outlines_lib}
