"""Greedy equality with transformers on 50 real ShareGPT prompts of mixed length, alone and 16 at a time
with staggered arrivals, in fp32: on a tiny random Llama with SmolLM2's vocabulary, and on SmolLM2 itself.
A divergence is allowed only at a near-tie in the reference, which the check reports rather than hides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from assets.datasets import sharegpt_first_turns
from engine.model_runner import ModelRunner
from tests.conftest import MODELS_DIR
from tests.engine.driver import assert_same_or_near_tie, generate_greedy

N_PROMPTS, MAX_PROMPT, NEW_TOKENS = 50, 160, 8


@pytest.fixture(scope="module")
def sharegpt_prompts(prepared_models: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(MODELS_DIR / "smollm2-135m-instruct" / "tokenizer.json"))
    out = []
    for i, text in enumerate(sharegpt_first_turns(limit=N_PROMPTS)):
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append(ids[: 4 + (i * 37) % MAX_PROMPT] or [1])  # mixed lengths, 4 to 163 tokens
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, rope_theta=100000.0)
    path = tmp_path_factory.mktemp("tiny-llama-49k")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def reference_greedy(ref: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_50_prompts(model_dir: Path, prompts: list[list[int]]) -> None:
    assert len(prompts) == N_PROMPTS and len({len(p) for p in prompts}) > 20
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [reference_greedy(ref, p) for p in prompts]
    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=1 << 26)
    for prompt, want in zip(prompts, expected, strict=True):
        [ours], _ = generate_greedy(runner, [prompt], NEW_TOKENS)
        assert_same_or_near_tie(ref, prompt, ours, want)
    for start in range(0, N_PROMPTS, 16):  # batches of 16 (the last one of 2)
        batch = prompts[start:start + 16]
        outs, _ = generate_greedy(runner, batch, NEW_TOKENS, arrivals=[i * 3 for i in range(len(batch))],
                                  max_num_batched_tokens=128)
        for prompt, ours, want in zip(batch, outs, expected[start:start + 16], strict=True):
            assert_same_or_near_tie(ref, prompt, ours, want)


def test_50_sharegpt_prompts_alone_and_staggered(model_dir: Path, sharegpt_prompts: list[list[int]]) -> None:
    check_50_prompts(model_dir, sharegpt_prompts)


@pytest.mark.model
def test_50_sharegpt_prompts_on_smollm2(prepared_models: Path, sharegpt_prompts: list[list[int]]) -> None:
    check_50_prompts(prepared_models / "smollm2-135m-instruct", sharegpt_prompts)
