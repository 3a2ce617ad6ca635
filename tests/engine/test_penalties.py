"""OpenAI's presence and frequency penalties in the engine: the sampler's arithmetic on a row of logits, and the
greedy shortcut, the speculative decoder and preemption around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.model_runner import ModelRunner
from engine.sampler import Sampler, count_tokens, penalize
from engine.sampling_params import SamplingParams
from engine.speculative import eligible
from tests.engine.driver import generate_greedy

NEAR_TIE = 1e-4


def test_each_token_is_lowered_by_its_count_and_once_for_being_there() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    got = penalize(logits, count_tokens([3, 1, 3, 3], 5), params)
    # token 3 three times: 4 - 3 * 0.5 - 0.25; token 1 once: 2 - 0.5 - 0.25; the others untouched
    assert got.tolist() == [1.0, 1.25, 3.0, 2.25, 5.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # the caller's row stays the model's


def test_negative_penalties_raise_the_tokens_already_made() -> None:
    logits = torch.zeros(4)
    got = penalize(logits, count_tokens([2, 2], 4), SamplingParams(frequency_penalty=-1.5, presence_penalty=-2.0))
    assert got.tolist() == [0.0, 0.0, 5.0, 0.0]


def test_only_the_output_counts_and_none_changes_nothing() -> None:
    logits = torch.tensor([0.5, -1.0, 2.0])
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalize(logits, count_tokens([], 3), params).tolist() == logits.tolist()
    assert not SamplingParams(temperature=0, presence_penalty=0.0, frequency_penalty=0).penalized


def test_a_greedy_request_picks_the_argmax_of_the_penalized_logits() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, -1.0])
    plain = SamplingParams(temperature=0)
    penalized = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert plain.greedy and not penalized.greedy  # the runner's raw-argmax shortcut is not taken
    s = Sampler()
    assert s.sample("a", logits, plain, [1]) == 1  # no penalty: the output is not read
    assert s.sample("b", logits, penalized, []) == 1
    assert s.sample("c", logits, penalized, [1]) == 2  # 3.0 - 1.0 < 2.5
    raised = SamplingParams(temperature=0, frequency_penalty=-2.0, presence_penalty=-2.0)
    assert s.sample("d", logits, raised, [3, 3]) == 3  # -1 + 2 * 2 + 2 > 3.0


def test_a_sampled_request_draws_from_the_penalized_distribution() -> None:
    """Temperature, top-k and top-p come after the penalties: a token penalised out of the top-1 is never drawn."""
    logits = torch.tensor([0.0, 3.0, 2.5, -1.0])
    params = SamplingParams(temperature=1.0, top_k=1, seed=3, frequency_penalty=2.0)
    s = Sampler()
    assert {s.sample("r", logits, params, [1, 1]) for _ in range(20)} == {2}


def test_a_penalized_request_is_never_drafted_for() -> None:
    assert eligible(SamplingParams(temperature=0))
    assert not eligible(SamplingParams(temperature=0, presence_penalty=0.1))
    assert not eligible(SamplingParams(temperature=0.7, frequency_penalty=-0.1))


def _reference(ref: LlamaForCausalLM, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding of `prompt` under `params`' penalties, computed over the whole sequence each token, as the rule
    reads; the first choice of a near-tie (top-2 gap under NEAR_TIE) is marked by a negative token."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            row = ref(torch.tensor([prompt + out])).logits[0, -1]
            row = penalize(row, count_tokens(out, row.numel()), params)
            top2 = torch.topk(row, 2)
            gap = float(top2.values[0] - top2.values[1])
            out.append(int(top2.indices[0]) if gap >= NEAR_TIE else -1)
            if out[-1] < 0:
                break
    return out


def test_greedy_with_penalties_matches_the_rule_and_survives_preemption(tiny_llama: Path) -> None:
    """On a tiny random Llama: the penalized greedy answers equal a plain re-computation of the rule (to the first
    near-tie), in a batch under preemption, whose resumed sequences count the output they had."""
    ref = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22, block_size=4)
    g = torch.Generator().manual_seed(3)
    batch = [[1, *torch.randint(2, 250, (int(n),), generator=g).tolist()] for n in torch.randint(1, 60, (6,),
                                                                                                    generator=g)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    outs, sched = generate_greedy(runner, batch, 24, num_kv_blocks=60, max_num_batched_tokens=128, params=params)
    assert sched.num_preemptions_total > 0
    plain, _ = generate_greedy(runner, batch, 24)
    assert outs != plain
    for prompt, ours in zip(batch, outs, strict=True):
        expected = _reference(ref, prompt, 24, params)
        tied = expected.index(-1) if -1 in expected else len(expected)
        assert ours[:tied] == expected[:tied]


@pytest.mark.model
def test_strong_penalties_make_smollm2_repeat_itself_less(prepared_models: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = prepared_models / "smollm2-135m-instruct"
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "Write the word 'apple' thirty times, separated by commas."}]
    prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    runner = ModelRunner(model_dir, dtype="fp32", kv_cache_bytes=64 << 20)
    [plain], _ = generate_greedy(runner, [prompt], 48)
    strong = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    [penalized], _ = generate_greedy(runner, [prompt], 48, params=strong)

    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    assert penalized != plain
    assert repeats(penalized) < repeats(plain) // 2, (tok.decode(plain), tok.decode(penalized))


def test_the_counts_kept_between_steps_are_the_outputs_counted_whole() -> None:
    """The sampler extends a request's counts by the tokens made since its last step; each step's penalized row is the
    rule's on the whole output, bit for bit, and a request released and reused starts afresh."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, generator=gen)
    params = SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=-0.3)
    s, out = Sampler(), []
    for step in range(40):
        out.append(int(torch.randint(0, 64, (1,), generator=gen)))
        kept = s._output_counts("r", out, 64)
        assert torch.equal(penalize(logits, kept, params), penalize(logits, count_tokens(out, 64), params)), step
    s.release("r")
    assert torch.equal(s._output_counts("r", [3], 64), count_tokens([3], 64))
    assert torch.equal(s._output_counts("q", out[:5], 64), count_tokens(out[:5], 64))
    assert torch.equal(s._output_counts("q", out[:2], 64), count_tokens(out[:2], 64))  # not the counted one grown
