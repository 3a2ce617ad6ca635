"""Model-free runners for the speculative decoding tests, whose distributions are known: a constant distribution
(`ConstantRunner`), a greedy chain as an engine's runner (`ChainRunner`), and the drivers that run a decoder as the
engine does (`decode` one sequence, `decode_through_engines` one request through a plain engine and a speculative
one). Shared by tests/engine/test_speculative*.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.draft_cost import DraftCosts
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import DEFAULT_COSTS, SpeculativeConfig, SpeculativeDecoder
from tests.engine.fakes import CharTokenizer, collect

P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])  # the target's next-token distribution, whatever the context
Q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.20])  # a poor draft's
CHI2_4DOF_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


class ConstantRunner:
    """A runner whose logits are the same for every row: log `probs`, or a greedy chain if `chain` is set."""

    def __init__(self, probs: torch.Tensor, chain: dict[int, int] | None = None) -> None:
        self.config = SimpleNamespace(vocab_size=len(probs))
        self.num_kv_blocks, self.block_size = 4096, 16
        self.sampler = Sampler()
        self.logprobs = probs.log()
        self.chain = chain  # position -> the argmax token there (greedy tests)
        self.rows = 0

    def logits_of_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                       wanted: list[int]) -> torch.Tensor:
        self.rows += len(token_ids)
        if self.chain is None:
            return self.logprobs.repeat(len(wanted), 1)
        out = torch.full((len(wanted), len(self.logprobs)), -5.0)
        for r, w in enumerate(wanted):
            out[r, self.chain[positions[w] + 1]] = 5.0  # the row at position p predicts the token at p + 1
        return out


class ChainRunner(ConstantRunner):
    """A greedy `chain` as an engine's runner: its plain steps (`run`) pick the chain's token as its rows do."""

    def __init__(self, chain: dict[int, int]) -> None:
        super().__init__(P, chain)
        self.max_model_len = 4096
        self.eos_token_ids: set[int] = set()
        self.last_logprobs: dict[str, Any] = {}
        self.last_errors: dict[str, str] = {}
        self.last_error_codes: dict[str, str] = {}
        self.last_grammar_limits: set[str] = set()

    def run(self, out: SchedulerOutput) -> list[int]:
        assert self.chain is not None
        return [self.chain[s.num_tokens] for s, sample in zip(out.seqs, out.do_sample, strict=True) if sample]

    def release(self, request_id: str) -> None:
        pass


TARGET_CHAIN = {p: (3 * p + 1) % 5 for p in range(1, 4000)}
DRAFT_CHAIN = {p: t if p % 4 else (t + 1) % 5 for p, t in TARGET_CHAIN.items()}  # wrong at every 4th position


def draft_rows_per_step(engine: LLMEngine, draft: Any) -> list[int]:
    """Record the rows the draft runs in each of the engine's steps (the loop calls `step` on the instance)."""
    rows: list[int] = []

    def step() -> bool:
        before = draft.rows
        ran = LLMEngine.step(engine)
        if ran:
            rows.append(draft.rows - before)
        return ran

    engine.step = step  # type: ignore[method-assign]
    return rows


def decode(spec: SpeculativeDecoder, params: SamplingParams, steps: int, prompt_len: int = 3) -> list[list[int]]:
    """Run `steps` speculative steps of one sequence the way the engine does; the tokens of each step."""
    blocks = BlockManager(4096, 16)
    seq = Sequence("r", list(range(prompt_len)), params)
    blocks.allocate_slots(seq, prompt_len)
    seq.num_computed_tokens = prompt_len - 1  # the prompt is in the cache but for its last token
    made = []
    for _ in range(steps):
        out = SchedulerOutput([seq], [1], [True])
        assert spec.applies(out)
        tokens = spec.run(out, blocks, max_model_len=1 << 20)
        assert tokens is not None
        made.append(tokens[0])
        seq.output_token_ids += tokens[0]
        seq.num_computed_tokens = seq.num_tokens - 1
    spec.release("r")
    return made


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


async def decode_through_engines(prompt: list[int], params: SamplingParams,
                                 draft_chain: dict[int, int] = DRAFT_CHAIN,
                                 costs: DraftCosts | None = DEFAULT_COSTS) -> tuple[SpeculativeDecoder, list[int]]:
    """One request through a plain engine and a speculative one (`costs`: the decoder's cost model, None to draft
    whenever it can); asserts both made the target's greedy chain; the decoder and the rows its draft read in each
    step."""
    plain = LLMEngine(ChainRunner(TARGET_CHAIN), CharTokenizer())
    draft = ConstantRunner(P, draft_chain)
    spec = SpeculativeDecoder(ChainRunner(TARGET_CHAIN), draft, SpeculativeConfig(k=4, max_batch=1, costs=costs))
    engine = LLMEngine(spec.target, CharTokenizer(), speculative=spec)
    rows = draft_rows_per_step(engine, draft)
    for e in (plain, engine):
        e.start()
    try:
        (text, last), (expected, _) = [await collect(e.generate(prompt, params)) for e in (engine, plain)]
    finally:
        for e in (plain, engine):
            e.shutdown()
    n = len(prompt)
    assert text == expected == "".join(chr(TARGET_CHAIN[p]) for p in range(n, n + params.max_tokens)
                                       if TARGET_CHAIN[p])
    assert last.num_output_tokens == params.max_tokens
    return spec, rows
