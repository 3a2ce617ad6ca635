"""Turns one sequence's logits into its next token: grammar mask, then greedy, temperature, top-k, top-p, seeded.

A seeded request gets its own torch.Generator, which takes any seed in 0..2^64-1 (SamplingParams checks
the range, so the generator never sees a seed it would refuse).

A request with a response format (`params.grammar`, set by the engine) gets its own grammar matcher
(engine/grammar.py) on its first token: each token, every token its grammar refuses is set to -inf before the
sampling rule runs (EOS among them until the JSON is complete), and the matcher advances by the token chosen.
The runner takes the argmax of the raw logits itself only for unconstrained greedy requests (`params.greedy`).
Both the generator and the matcher live until `release`, so a preempted request resumes where it was.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, Any] = {}  # request id -> engine/grammar.py's GrammarMatcher

    def sample(self, request_id: str, logits: torch.Tensor, params: SamplingParams) -> int:
        # logits: [V] float32
        matcher = self._matcher(request_id, params)
        if matcher is not None:
            logits = matcher.mask(logits)  # a new tensor: the caller's logits stay the model's (logprobs)
        token = self._choose(request_id, logits, params)
        if matcher is not None:
            matcher.accept(token)
        return token

    def _choose(self, request_id: str, logits: torch.Tensor, params: SamplingParams) -> int:
        if params.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = self.distribution(logits, params)
        return int(torch.multinomial(probs, 1, generator=self.generator(request_id, params)))

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
            sorted_probs, sorted_idx = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = cumulative - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, sorted_idx, sorted_probs)
        return probs

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The request's own generator when it is seeded (kept until `release`); None: torch's global one."""
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def _matcher(self, request_id: str, params: SamplingParams) -> Any:
        if params.grammar is None:
            return None
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = params.grammar.matcher()
        return matcher
