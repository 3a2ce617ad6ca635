"""Greedy equality with transformers on 50 real ShareGPT prompts of mixed length, alone and 16 at a time
with staggered arrivals, in fp32: on a tiny random Llama with SmolLM2's vocabulary, and on SmolLM2 itself.
A divergence is allowed only at a near-tie in the reference, which the check reports rather than hides.

Each distinct answer of ours is checked against transformers in one teacher-forced forward pass
(tests/engine/driver.py: our token is the reference's top one at every step, so the sequences are equal) rather
than against transformers' `generate`, a forward per token through its Python layers: 74% of this test's time on
SmolLM2 went there (py-spy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from assets.datasets import sharegpt_first_turns
from engine.model_runner import ModelRunner
from tests.conftest import MODELS_DIR
from tests.engine.driver import assert_reference_greedy, generate_greedy

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


def check_50_prompts(model_dir: Path, prompts: list[list[int]]) -> None:
    assert len(prompts) == N_PROMPTS and len({len(p) for p in prompts}) > 20
    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=1 << 26)
    answers = [generate_greedy(runner, [prompt], NEW_TOKENS)[0][0] for prompt in prompts]
    for start in range(0, N_PROMPTS, 16):  # batches of 16 (the last one of 2)
        batch = prompts[start:start + 16]
        outs, _ = generate_greedy(runner, batch, NEW_TOKENS, arrivals=[i * 3 for i in range(len(batch))],
                                  max_num_batched_tokens=128)
        answers += outs
    assert all(len(a) == NEW_TOKENS for a in answers)
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # every answer, alone and staggered, checked; one check for a prompt whose two answers are the same
    for prompt, ours in dict.fromkeys(zip(map(tuple, prompts * 2), map(tuple, answers), strict=True)):
        assert_reference_greedy(ref, list(prompt), list(ours))


def test_50_sharegpt_prompts_alone_and_staggered(model_dir: Path, sharegpt_prompts: list[list[int]]) -> None:
    check_50_prompts(model_dir, sharegpt_prompts)


@pytest.mark.model
def test_50_sharegpt_prompts_on_smollm2(prepared_models: Path, sharegpt_prompts: list[list[int]]) -> None:
    check_50_prompts(prepared_models / "smollm2-135m-instruct", sharegpt_prompts)


def test_the_teacher_forced_check_fails_a_wrong_token_and_reports_a_near_tie() -> None:
    class Ref:  # the top token at every position is 3; `second` is token 5's logit, 4 one below the top
        def __init__(self, second: float) -> None:
            self.second = second

        def __call__(self, ids: torch.Tensor, logits_to_keep: int) -> object:
            logits = torch.zeros(1, logits_to_keep, 8)
            logits[0, :, 3], logits[0, :, 5], logits[0, :, 4] = 2.0, self.second, 1.0
            return type("Out", (), {"logits": logits})()

    assert_reference_greedy(Ref(1.0), [1, 2], [3, 3, 3])
    with pytest.raises(AssertionError, match="output token 1 is 5"):
        assert_reference_greedy(Ref(1.0), [1, 2], [3, 5, 3])
    with pytest.raises(AssertionError, match="output token 2 is 4"):  # 4 is not in the near tie of 3 and 5
        assert_reference_greedy(Ref(2.0 - 1e-5), [1, 2], [3, 3, 4])
    with pytest.warns(UserWarning, match="near-tie divergence at output token 1"):
        assert_reference_greedy(Ref(2.0 - 1e-5), [1, 2], [3, 5, 4])  # after the tie, another context
