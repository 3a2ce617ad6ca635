"""The divergence risk of a cheap answer while it is made: the cascade's stop at an arbitrary token.

Why: `mid` is `full` quantized, so their greedy answers are the same until a token where the two most likely
next tokens are close enough for int8's error to swap them, and how much of the answer comes after that token
is what fidelity loses (BENCHMARKS.md, "Session 46: issue 23 cascade signal"). So per token of the cheap answer
the risk adds the rate at which answers parted at a token of its top-2 margin on the training answers (the
`hazard` of its margin bin, `edges` in nats), weighted by the share of the answer still to come,
((width − t) / width) ** power; when the sum passes the pair's `threshold`, the answer is stopped there (billed
for its prompt and the tokens made) and the strong tier answers.

`width` is the answer length the weighting was fitted at (bench/router.py's --max-tokens), not a request's
`max_tokens`: the hazard, the power and the threshold were chosen together on answers of that length, and a
request's cap would rescale every token's weight (a cap of 500 would make each early token count about as
fully as the first token did in training, and the threshold then stops answers it was never meant to). A token
past `width` adds nothing (the share is clipped at 0: the training answers had no such token).

A token that came with fewer than two alternatives has no margin: it adds the last bin's rate, as a margin
above every edge would (the bench's answers always had five). The risk passes only once a token had a margin: a tier
that sends none is "not checked", and its answer stands (a fitted hazard is never 0, training/divergence_fit.py's
smoothing, so its last bin's rate alone would stop every answer of a tier without alternatives past some length).

One implementation serves the gateway (gateway/pipeline/meter.py feeds `DivergenceRisk` the tier's chunks, O(1)
per token) and the benchmark (bench/stop_cascade.py's `risk_gaps` runs `cumulative_risk` over its answers), so
the threshold the benchmark fits is the one the gateway applies. The stop is part of the router's artifact
(tiers/difficulty.py's `CascadeCalibration.stops`, per tier pair), checked strictly on load (`from_json`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

# margin bins (nats between the two most likely tokens) the hazard is measured on (session 46's)
HAZARD_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 4.0, math.inf)
MAX_STOP_WIDTH = 32768  # tokens: an answer length to weigh by no training run has made


@dataclass(frozen=True)
class DivergenceStop:
    """One tier pair's stop: stop `cheap`'s answer where its divergence risk passes `threshold`, and retry on
    `strong`."""

    cheap: str
    strong: str
    edges: tuple[float, ...]  # [B + 1] ascending margin bin edges, from 0 to +inf
    hazard: tuple[float, ...]  # [B] the training parting rate per bin, each within [0, 1]
    power: float  # the weight's power of the share still to come (0: every token alike)
    width: int  # the answer length (tokens) the weighting and threshold were fitted at
    threshold: float  # stop where the risk is above this
    quality: float  # the mean quality the threshold was chosen to keep on the training answers (the target it
    # reached: QUALITY_TARGET times strong's mean, in fidelity to the reference); routes with a floor above it are
    # judged otherwise

    def rate(self, margin: float) -> float:
        """The parting rate of a token with this top-2 margin (nats; +inf: no margin known)."""
        k = bisect_right(self.edges, max(margin, 0.0)) - 1
        return self.hazard[min(k, len(self.hazard) - 1)]

    def weight(self, t: int) -> float:
        """Token t's (from 0) weight: the share of a `width`-token answer still to come, to `power`; 0 past it
        (at power 0 too, where 0 ** 0 would be 1)."""
        if t >= self.width:
            return 0.0
        return ((self.width - t) / self.width) ** self.power

    def to_json(self) -> dict[str, Any]:
        return {"cheap": self.cheap, "strong": self.strong, "edges": list(self.edges), "hazard": list(self.hazard),
                "power": self.power, "width": self.width, "threshold": self.threshold,
                "quality": self.quality}

    @classmethod
    def from_json(cls, d: Any) -> DivergenceStop:
        """Checked field by field: a ValueError names what is wrong (the artifact is refused, not half-read)."""
        if not isinstance(d, dict):
            raise ValueError("a stop must be an object")
        missing = {"cheap", "strong", "edges", "hazard", "power", "width", "threshold", "quality"} - set(d)
        if missing:
            raise ValueError(f"missing {', '.join(sorted(missing))}")
        cheap, strong = d["cheap"], d["strong"]
        if not isinstance(cheap, str) or not cheap or not isinstance(strong, str) or not strong or cheap == strong:
            raise ValueError("`cheap` and `strong` must be two tier names")
        edges, hazard = _numbers(d["edges"], "edges"), _numbers(d["hazard"], "hazard")
        if (len(edges) < 2 or edges[0] != 0.0 or edges[-1] != math.inf
                or any(b <= a for a, b in pairwise(edges))):
            raise ValueError("`edges` must rise strictly from 0 to Infinity")
        if len(hazard) != len(edges) - 1 or not all(0.0 <= h <= 1.0 for h in hazard):
            raise ValueError(f"`hazard` must be {len(edges) - 1} rates within [0, 1] (one per bin of `edges`)")
        power, threshold, width = _number(d["power"], "power"), _number(d["threshold"], "threshold"), d["width"]
        if not math.isfinite(power) or power < 0:
            raise ValueError("`power` must be a finite number >= 0")
        if not math.isfinite(threshold) or threshold < 0:
            raise ValueError("`threshold` must be a finite number >= 0")
        if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_STOP_WIDTH:
            raise ValueError(f"`width` must be an integer within 1..{MAX_STOP_WIDTH}")
        quality = _number(d["quality"], "quality")
        if not 0.0 <= quality <= 1.0:
            raise ValueError("`quality` must be a share within [0, 1]")
        return cls(cheap, strong, edges, hazard, power, width, threshold, quality)


def _number(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
        raise ValueError(f"`{name}` must be a number")
    return float(v)


def _numbers(v: Any, name: str) -> tuple[float, ...]:
    if not isinstance(v, list):
        raise ValueError(f"`{name}` must be a list of numbers")
    return tuple(_number(x, name) for x in v)


class DivergenceRisk:
    """The risk of one answer so far, token by token (O(1) each); it stops adding at the token where it passed
    the stop's threshold, so `value` and `passed_at` say where the answer is to be stopped."""

    def __init__(self, stop: DivergenceStop) -> None:
        self.stop = stop
        self.value = 0.0
        self.num_tokens = 0
        self.num_with_top = 0  # tokens that came with two alternatives or more (a margin)
        self.passed_at: int | None = None  # the token (counted from 1) at which the risk passed the threshold

    @property
    def passed(self) -> bool:
        return self.passed_at is not None

    def add(self, top: Iterable[float]) -> None:
        """One token, by its alternatives' log-probabilities (any order; non-finite ones are none)."""
        if self.passed_at is not None:
            return
        first = second = -math.inf
        for v in top:
            if not math.isfinite(v):
                continue
            if v > first:
                first, second = v, first
            elif v > second:
                second = v
        if second > -math.inf:
            self.num_with_top += 1
        margin = first - second if second > -math.inf else math.inf
        self.value += self.stop.rate(margin) * self.stop.weight(self.num_tokens)
        self.num_tokens += 1
        if self.value > self.stop.threshold and self.num_with_top:  # no margin yet: no evidence (the docstring)
            self.passed_at = self.num_tokens

    def add_openai(self, logprobs: object) -> None:
        """The tokens of one choice's `logprobs` field, OpenAI's shape ({"content": [{"logprob", "top_logprobs"}]},
        as tiers/cascade.py's `AnswerSignals.add_openai` reads it)."""
        if not isinstance(logprobs, dict):
            return
        for tok in logprobs.get("content") or []:
            if self.passed_at is not None:
                return
            if not isinstance(tok, dict) or not isinstance(tok.get("logprob"), int | float):
                continue
            alternatives = tok.get("top_logprobs")
            self.add(float(t["logprob"]) for t in (alternatives if isinstance(alternatives, list) else ())
                     if isinstance(t, dict) and isinstance(t.get("logprob"), int | float)
                     and not isinstance(t.get("logprob"), bool))

    def note(self) -> str:
        """For the route reason: where it passed, or what it came to."""
        threshold = self.stop.threshold
        if self.passed_at is not None:
            return f"divergence risk {self.value:.2f} > {threshold:.2f} at token {self.passed_at}"
        if self.num_with_top == 0:
            return "divergence risk not checked (the tier sent no top log-probabilities)"
        return f"divergence risk {self.value:.2f} within {threshold:.2f} over {self.num_tokens} tokens"


def cumulative_risk(tops: Iterable[Sequence[float]], stop: DivergenceStop) -> list[float]:
    """The risk after each token of an answer given by its tokens' alternatives (the benchmark's, over answers
    it made; `stop.threshold` is not applied: every token is counted)."""
    risk = DivergenceRisk(DivergenceStop(stop.cheap, stop.strong, stop.edges, stop.hazard, stop.power, stop.width,
                                         math.inf, stop.quality))
    out = []
    for top in tops:
        risk.add(top)
        out.append(risk.value)
    return out
