"""Integration: speculative decoding in our engine on SmolLM2-135M-Instruct, the int8 model drafting for fp32.

Greedy answers through the speculative engine equal the plain engine's, token for token, with EOS, max_tokens
and stop strings ending them at the same token; requests it does not apply to (logprobs) still work; every KV
block, the draft's included, goes back; the model version says a draft is on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.launch import DraftModel, build_engine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


async def answer(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str | None, int]:
    ids, text, last = [], "", None
    async for out in engine.generate(prompt, params):
        ids += out.token_ids
        text += out.text
        last = out
    assert last is not None and last.error is None
    return ids, text, last.finish_reason, last.num_output_tokens


async def answers(engine: Any, jobs: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    return await asyncio.gather(*(answer(engine, p, s) for p, s in jobs))


@pytest.fixture(scope="module")
def engines(prepared_models: Path) -> Any:
    plain, plain_version = build_engine("smollm2-135m-instruct", prepared_models, dtype="fp32",
                                        kv_cache_bytes=64 << 20, max_num_seqs=8)
    draft = DraftModel("smollm2-135m-instruct", quantize="int8", k=4, max_batch=4, kv_cache_bytes=32 << 20)
    spec, spec_version = build_engine("smollm2-135m-instruct", prepared_models, dtype="fp32",
                                      kv_cache_bytes=64 << 20, max_num_seqs=8, draft=draft)
    for e in (plain, spec):
        e.start()
    yield plain, spec, plain_version, spec_version
    for e in (plain, spec):
        e.shutdown()


def test_greedy_answers_equal_the_plain_engines(engines: Any) -> None:
    plain, spec, plain_version, spec_version = engines
    tok = plain.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for c in CHATS]
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    jobs = [(p, greedy) for p in prompts]
    jobs.append((prompts[0], dataclasses.replace(greedy, max_tokens=3)))  # fewer tokens left than k
    jobs.append((prompts[1], dataclasses.replace(greedy, max_tokens=200)))  # ends at EOS
    expected = asyncio.run(answers(plain, jobs))
    before = spec.stats()
    got = asyncio.run(answers(spec, jobs))
    assert got == expected
    # a stop string inside a step's tokens ends the answer there, as in plain decoding
    stop_at = expected[0][1].split()[2]
    with_stop = [(prompts[0], dataclasses.replace(greedy, stop=[stop_at]))]
    assert asyncio.run(answers(spec, with_stop)) == asyncio.run(answers(plain, with_stop))
    stats = spec.stats()
    assert stats.num_speculative_steps_total > before.num_speculative_steps_total
    kept = stats.num_accepted_draft_tokens_total / stats.num_draft_tokens_total
    assert kept > 0.5, kept  # the int8 model agrees with fp32 on most tokens
    assert plain_version != spec_version


def test_requests_it_does_not_apply_to_take_plain_steps(engines: Any) -> None:
    plain, spec, _, _ = engines
    tok = plain.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": CHATS[2]}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    steps = spec.stats().num_speculative_steps_total
    assert asyncio.run(answers(spec, [(prompt, params)])) == asyncio.run(answers(plain, [(prompt, params)]))
    assert spec.stats().num_speculative_steps_total == steps


def test_seeded_sampling_repeats_and_every_block_goes_back(engines: Any) -> None:
    _, spec, _, _ = engines
    tok = spec.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": CHATS[1]}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40)
    first = asyncio.run(answers(spec, [(prompt, params)] * 2))
    assert first[0] == first[1] == asyncio.run(answers(spec, [(prompt, params)]))[0]
    drafts = spec.speculative.blocks
    assert drafts.num_free_blocks == drafts.num_blocks
    assert spec.stats().num_kv_blocks_used == 0
