"""Running slots shared between tenants, on SmolLM2: a tenant whose long generations fill the batch hands a slot to
another tenant's request at once, and the sequence it preempts resumes to the same greedy answer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.engine.driver import assert_same_or_near_tie

pytestmark = pytest.mark.model

CHATS = [
    "Write a long story about a lighthouse keeper.",
    "Describe the water cycle in detail.",
    "Tell me everything you know about volcanoes.",
    "Explain how a bicycle works, part by part.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def model_dir(prepared_models: Path) -> Path:
    return prepared_models / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for c in CHATS]


def test_a_sequence_preempted_for_another_tenant_resumes_to_the_same_greedy_answer(
        model_dir: Path, prompts: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=64 << 20)
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=runner.max_model_len, eos_token_ids=set())

    def greedy(rid: str, prompt: list[int], max_tokens: int, t: float, salt: str) -> Sequence:
        return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        arrival_time=t, cache_salt=salt)

    def step() -> None:
        out = sched.schedule()
        sched.postprocess(out, runner.run(out))

    attackers = [greedy(f"a{k}", p, 16, k, "attacker") for k, p in enumerate(prompts[:4])]
    for seq in attackers:
        sched.add_request(seq)
    while min(a.num_output_tokens for a in attackers) < 6:  # every slot held, each answer under way
        step()
    victim = greedy("victim", prompts[4], 4, 10, "victim")
    sched.add_request(victim)
    while sched.has_unfinished_requests():
        step()
    assert [a.num_preemptions for a in attackers] == [0, 0, 0, 1]  # the youngest gave its slot up, and came back
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq in [*attackers, victim]:
        expected = ref.generate(torch.tensor([seq.prompt_token_ids]), max_new_tokens=seq.params.max_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, seq.num_prompt_tokens:]
        assert_same_or_near_tie(ref, seq.prompt_token_ids, seq.output_token_ids, expected.tolist())


async def test_a_victims_first_token_comes_at_once_while_an_attacker_holds_every_slot(
        model_dir: Path, prompts: list[list[int]]) -> None:
    """Before, the victim's first token came when one of the attacker's answers ended (each attacker answer made
    its 128 tokens meanwhile); now within a step or two of its arrival."""
    from transformers import AutoTokenizer

    eng = LLMEngine(ModelRunner(model_dir, kv_cache_bytes=64 << 20), AutoTokenizer.from_pretrained(model_dir),
                    max_num_seqs=4)
    eng.start()
    made = [0] * 4  # tokens each attacker answer has streamed

    async def attack(k: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        async for out in eng.generate(prompts[k], params, cache_salt="attacker"):
            made[k] += len(out.token_ids)

    try:
        attackers = [asyncio.ensure_future(attack(k)) for k in range(4)]
        while min(made) < 2:
            await asyncio.sleep(0.01)
        before, t0 = list(made), time.perf_counter()
        victim = eng.generate(prompts[4], SamplingParams(temperature=0, max_tokens=4), cache_salt="victim")
        await anext(victim)
        ttft, during = time.perf_counter() - t0, [m - b for m, b in zip(made, before, strict=True)]
        async for _ in victim:
            pass
        assert max(during) <= 4, f"attacker tokens before the victim's first: {during} ({ttft:.2f} s)"
        assert not any(a.done() for a in attackers)
        await asyncio.gather(*attackers)
        assert made == [128] * 4 and eng.stats().num_preemptions_total == 1
    finally:
        eng.shutdown()
