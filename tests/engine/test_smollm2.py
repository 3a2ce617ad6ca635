"""Integration: our engine on SmolLM2-135M-Instruct (fp32) against transformers' greedy output.

A few real chat prompts of mixed length, run as one continuous batch with staggered arrivals; each must
equal transformers' `generate` token for token, except at a reported near-tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model_runner import ModelRunner
from tests.engine.driver import assert_same_or_near_tie, generate_greedy

pytestmark = pytest.mark.model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, for a ten-year-old who loves dinosaurs and asks many "
    "questions about light, colours and the air around us.",
    "List three uses of a paperclip.",
    "Translate 'good morning, how are you?' into Spanish and German.",
]


def test_smollm2_batch_matches_transformers_greedy(prepared_models: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepared_models / "smollm2-135m-instruct"
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for c in CHATS]
    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=64 << 20)
    outs, _ = generate_greedy(runner, prompts, 16, arrivals=[0, 0, 1, 3, 4], max_num_batched_tokens=64)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, outs, strict=True):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert_same_or_near_tie(ref, prompt, ours, expected)
