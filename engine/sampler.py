"""Turns one sequence's logits into its next token: penalties and grammar mask, then greedy, temperature, top-k,
top-p, seeded.

OpenAI's presence and frequency penalties (`penalize`) read the sequence's output so far, which the caller hands
over (`Sequence.output_token_ids`): each token's logit is lowered by frequency_penalty times its count there, and by
presence_penalty once it is there; the prompt's tokens are not counted, as OpenAI documents and vLLM does. The counts
are kept per request ([V] float32, exact to 2^24) and extended by the tokens made since its last step, so a step
costs a few passes over the vocabulary whatever the output's length (counted whole each step, an 8K-token answer cost
8K list-to-tensor copies of up to 8K ids); a preempted request keeps its output, and so its counts, until `release`.

A seeded request gets its own generator: numpy's PCG64, whose seeding (a SeedSequence) uses every bit of any seed in
0..2^64-1 (SamplingParams checks the range). torch's CPU generator (mt19937) seeds from a seed's low 32 bits only:
seeds 0, 2^32 and 2^63 drew the same numbers, so distinct seeds gave the same answer. An unseeded request draws from
torch's global generator.

A request with a response format (`params.grammar`, set by the engine) gets its own grammar matcher
(engine/grammar.py) on its first token: each token, every token its grammar refuses is set to -inf before the
sampling rule runs (EOS among them until the JSON is complete), and the matcher advances by the token chosen.
The runner takes the argmax of the raw logits itself only for unconstrained greedy requests without penalties
(`params.greedy`).
Both the generator and the matcher live until `release`, so a preempted request resumes where it was.

Cost per sampled token on a 49,152-token vocabulary (2 threads, 2026-12-02): top-p looks at the 256 likeliest
tokens first (`torch.topk`, ~0.3 ms) and sorts the rest only when their mass falls short, where sorting the whole
vocabulary took ~5 ms (`torch.sort` on CPU); a token is drawn by inverse CDF over a float64 cumulative sum
(~0.07 ms, where `torch.multinomial` took ~1.4 ms).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.sampling_params import SamplingParams

TOP_P_FIRST = 256  # candidates top-p looks at first; all of them, sorted, when their mass falls short


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, np.random.Generator] = {}
        self._matchers: dict[str, Any] = {}  # request id -> engine/grammar.py's GrammarMatcher
        self._counts: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (output tokens counted, counts [V])

    def sample(self, request_id: str, logits: torch.Tensor, params: SamplingParams,
               output_token_ids: list[int] | None = None) -> int:
        """The next token from `logits` [V] float32, for a request whose output so far is `output_token_ids` (what
        its penalties count). The caller's logits are never changed: they stay the model's (logprobs)."""
        if params.penalized:
            logits = penalize(logits, self._output_counts(request_id, output_token_ids or [], logits.numel()), params)
        matcher = self._matcher(request_id, params)
        if matcher is not None:
            logits = matcher.mask(logits)  # a new tensor
        token = self._choose(request_id, logits, params)
        if matcher is not None:
            matcher.accept(token)
        return token

    def _choose(self, request_id: str, logits: torch.Tensor, params: SamplingParams) -> int:
        if params.temperature == 0.0:
            return int(torch.argmax(logits))
        return self.draw(self.distribution(logits, params), self.generator(request_id, params))

    @staticmethod
    def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The probabilities [V] a sampled (temperature > 0) request draws its next token from: temperature, then
        top-k, then top-p (the speculative decoder's acceptance rule compares two of these)."""
        # shift first: every logit is then <= 0, so dividing by a small temperature can reach -inf (a
        # probability of 0) but never +inf, and softmax never sees inf - inf = NaN
        logits = (logits - logits.max()) / params.temperature
        if params.top_k > 0 and params.top_k < logits.numel():
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            probs = _nucleus(probs, params.top_p)
        return probs

    @staticmethod
    def draw(probs: torch.Tensor, generator: np.random.Generator | None) -> int:
        """One token drawn from `probs` [V] (not negative, not all zero): the first whose cumulative mass passes
        a uniform draw scaled to the total. A token of probability 0 is never drawn."""
        cumulative = torch.cumsum(probs, 0, dtype=torch.float64)
        u = torch.tensor([uniform(generator)], dtype=torch.float64) * cumulative[-1]
        index = int(torch.searchsorted(cumulative, u, right=True))
        if index >= probs.numel():  # u rounded up to the total: the last token that has a probability
            index = int(torch.nonzero(probs)[-1])
        return index

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._counts.pop(request_id, None)

    def _output_counts(self, request_id: str, output_token_ids: list[int], size: int) -> torch.Tensor:
        """How often each token occurs in the request's output so far, [size]: its counts from the last step plus the
        tokens made since (counted afresh if the output is not the one counted so far grown at its end)."""
        counted, counts = self._counts.get(request_id, (0, None))
        if counts is None or counted > len(output_token_ids) or counts.numel() != size:
            counted, counts = 0, torch.zeros(size)
        if len(output_token_ids) > counted:
            new = torch.tensor(output_token_ids[counted:], dtype=torch.long)
            counts.index_add_(0, new, torch.ones(new.numel()))
        self._counts[request_id] = (len(output_token_ids), counts)
        return counts

    def generator(self, request_id: str, params: SamplingParams) -> np.random.Generator | None:
        """The request's own generator when it is seeded (kept until `release`); None: torch's global one."""
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = np.random.Generator(np.random.PCG64(params.seed))
            self._generators[request_id] = gen
        return gen

    def _matcher(self, request_id: str, params: SamplingParams) -> Any:
        if params.grammar is None:
            return None
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = params.grammar.matcher()
        return matcher


def uniform(generator: np.random.Generator | None) -> float:
    """A number drawn uniformly from [0, 1): from a seeded request's own generator, else from torch's global one."""
    if generator is None:
        return float(torch.rand(1, dtype=torch.float64))
    return float(generator.random())


def penalize(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits` [V] less OpenAI's penalties, as a new tensor: logit[j] - (frequency_penalty * count[j] +
    presence_penalty * (count[j] > 0)), `counts` [V] being how often each token occurs in the output so far
    (`count_tokens`; a negative penalty raises the logit). A few passes over the vocabulary."""
    return logits - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(counts.dtype))


def count_tokens(token_ids: list[int], size: int) -> torch.Tensor:
    """How often each of `size` tokens occurs in `token_ids`, [size] float32."""
    counts = torch.zeros(size)
    if token_ids:
        counts.index_add_(0, torch.tensor(token_ids, dtype=torch.long), torch.ones(len(token_ids)))
    return counts


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [V] kept on the smallest set of likeliest tokens whose mass reaches top_p (at least one token),
    zero elsewhere: what sorting the whole vocabulary gives. Tokens are taken in descending order, the likeliest
    TOP_P_FIRST first; when the last of them is dropped (the mass before it reaches top_p), every token after it
    would be too, and the rest of the vocabulary is never sorted. Otherwise (a flat distribution) the whole
    vocabulary is sorted by numpy's quicksort (~1.3 ms here; torch's CPU sort ~6 ms); tied probabilities may
    come in any order, as with any sort."""
    size = probs.numel()
    values, index = torch.topk(probs, min(TOP_P_FIRST, size))  # descending
    cumulative = torch.cumsum(values, dim=-1)
    drop = cumulative - values >= top_p
    if size > TOP_P_FIRST and not bool(drop[-1]):
        index = torch.from_numpy(np.argsort(-probs.numpy()))
        values = probs[index]
        cumulative = torch.cumsum(values, dim=-1)
        drop = cumulative - values >= top_p
    # the likeliest token is always kept: a top_p below float32's smallest number (1e-300 passes `> 0`) is 0 in
    # the comparison above, which then dropped every token, and the draw failed on an all-zero distribution (a 500
    # whose repeats opened the replica's breaker for every tenant)
    drop[0] = False
    return torch.zeros_like(probs).scatter_(0, index, values.masked_fill(drop, 0.0))
