"""The cascade's stop at a divergence risk: the risk's arithmetic (one implementation for the gateway and the
benchmark), and the artifact's `stops` section, refused on load when malformed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench.stop_cascade import risk_gaps
from tests.tiers.test_difficulty import HashEmbedder, make_model
from tiers.difficulty import load_difficulty_model
from tiers.divergence import HAZARD_EDGES, DivergenceRisk, DivergenceStop, cumulative_risk

HAZARD = np.array([0.45, 0.4, 0.32, 0.18, 0.15, 0.08, 0.03, 0.01, 0.005, 0.002, 0.001])
# per token (log-probability, top alternatives most likely first), as bench answers hold them
TOKENS = [(-0.1, [-0.1, -2.5, -4.0]), (-0.7, [-0.7, -0.75, -3.0]), (-0.2, [-0.2, -0.5]), (-1.0, [-1.0, -1.0]),
          (-0.05, [-0.05, -6.0, -7.0]), (-0.4, [-0.4, -0.52, -2.0]), (-0.3, [-0.3, -0.33])]


def session46_risk(tokens: list[tuple[float, list[float]]], hazard: np.ndarray, power: float, width: int) -> np.ndarray:
    """bench/stop_cascade.py's `risk_gaps` arithmetic as session 46 measured it (numpy, whole answer at once),
    negated back into the risk: the reference the shared implementation must equal."""
    edges = np.asarray(HAZARD_EDGES)
    margins = np.array([top[0] - top[1] for _, top in tokens[:width]])
    to_come = ((width - np.arange(len(margins))) / width) ** power
    return np.cumsum(hazard[np.searchsorted(edges, margins, side="right") - 1] * to_come)


def stop(threshold: float = 0.5, power: float = 3.0, width: int = 48) -> DivergenceStop:
    return DivergenceStop("mid", "full", HAZARD_EDGES, tuple(HAZARD.tolist()), power, width, threshold, 0.95)


class PerToken:
    """A tier's price, per token, as tiers.yaml's are linear."""

    def price(self, prompt: int, output: int) -> float:
        return 0.001 * prompt + 0.002 * output


@pytest.mark.parametrize(("power", "width"), [(0.0, 48), (1.0, 48), (3.0, 48), (2.0, 7), (3.0, 10)])
def test_the_risk_is_session_46s_and_the_benchs_is_the_gateways(power: float, width: int) -> None:
    want = session46_risk(TOKENS, HAZARD, power, width)
    got = cumulative_risk((top for _, top in TOKENS), stop(power=power, width=width))
    assert got == pytest.approx(want.tolist(), rel=1e-12, abs=0)
    # the benchmark's gaps are the same numbers (negated), made by the same code as the gateway's meter
    answer = SimpleNamespace(text="an answer", logprobs=TOKENS, token_ids=list(range(len(TOKENS))),
                             num_prompt_tokens=10)
    gap, cost = risk_gaps([answer], PerToken(), HAZARD, power, width)
    assert gap[0, :len(TOKENS)].tolist() == [-v for v in got]
    assert cost[0, 2] == pytest.approx(0.001 * 10 + 0.002 * 3)  # stopped at token 3: the prompt and 3 tokens
    # the gateway's, token by token from OpenAI's chunks (alternatives in any order), stops where it passes
    risk = DivergenceRisk(stop(threshold=float(want[3]) - 1e-9, power=power, width=width))
    for _, top in TOKENS:
        risk.add_openai({"content": [{"logprob": top[0], "top_logprobs": [{"logprob": v} for v in reversed(top)]}]})
    assert risk.passed_at == 4 and risk.value == pytest.approx(want[3], rel=1e-12) and risk.num_tokens == 4


def test_past_its_width_a_token_adds_nothing_and_a_token_without_a_margin_the_last_bins_rate() -> None:
    short = stop(threshold=100.0, power=1.0, width=2)
    risk = DivergenceRisk(short)
    for _ in range(5):
        risk.add([-0.1, -0.11])  # margin 0.01: the first bin
    assert risk.value == pytest.approx(HAZARD[0] * (1.0 + 0.5)) and risk.num_tokens == 5
    flat = DivergenceRisk(stop(threshold=100.0, power=0.0, width=2))  # 0 ** 0 is 1: past the width it must be 0
    for _ in range(5):
        flat.add([-0.1, -0.11])
    assert flat.value == pytest.approx(HAZARD[0] * 2) and [short.weight(t) for t in (2, 3)] == [0.0, 0.0]
    bare = DivergenceRisk(stop(threshold=100.0, power=0.0))
    bare.add([-0.3])
    bare.add([])
    assert bare.value == pytest.approx(2 * HAZARD[-1]) and bare.num_with_top == 0
    assert bare.note() == "divergence risk not checked (the tier sent no top log-probabilities)"


def test_the_notes_say_where_it_passed_or_what_it_came_to() -> None:
    risk = DivergenceRisk(stop(threshold=0.35, power=0.0))
    for _ in range(3):
        risk.add([-0.4, -0.41])  # 0.01 nats: 0.45 each
    assert risk.passed_at == 1 and risk.note() == "divergence risk 0.45 > 0.35 at token 1"
    calm = DivergenceRisk(stop(threshold=0.35, power=0.0))
    calm.add([-0.01, -5.0])
    assert not calm.passed and calm.note() == "divergence risk 0.00 within 0.35 over 1 tokens"


def stops_doc(**changes: object) -> dict[str, object]:
    doc = stop(threshold=0.35).to_json() | changes
    return {"mid->full": doc}


def artifact_with(tmp_path: Path, stops: object, top_logprobs: int = 5) -> Path:
    doc = make_model().to_json()
    doc["cascade"]["stops"] = stops
    doc["cascade"]["top_logprobs"] = top_logprobs
    path = tmp_path / "difficulty.json"
    path.write_text(json.dumps(doc))
    return path


def test_an_artifact_with_a_stop_round_trips_under_a_version_of_its_own(tmp_path: Path) -> None:
    model = make_model()
    with_stop = model.with_stops({"mid->full": stop(threshold=0.35)})
    assert with_stop.version.startswith(model.version + "+stop:") and with_stop.version != model.version
    assert model.with_stops({"mid->full": stop(threshold=0.36)}).version != with_stop.version
    assert with_stop.with_stops({}).version == model.version
    with_stop.save(tmp_path / "a.json")
    loaded = load_difficulty_model(tmp_path / "a.json", embedder=HashEmbedder())
    assert loaded.version == with_stop.version and loaded.cascade is not None
    assert loaded.cascade.stop("mid", "full") == stop(threshold=0.35) and loaded.cascade.stop("small", "full") is None
    assert load_difficulty_model(artifact_with(tmp_path, None), embedder=HashEmbedder()).cascade.stops == {}  # type: ignore[union-attr]


@pytest.mark.parametrize(("stops", "message"), [
    ([1, 2], "must be an object"),
    ({"mid->full": "x"}, "a stop must be an object"),
    (stops_doc(hazard=HAZARD.tolist()[:-1]), "`hazard` must be 11 rates"),
    (stops_doc(hazard=[1.5, *HAZARD.tolist()[1:]]), "`hazard` must be 11 rates"),
    (stops_doc(edges=list(HAZARD_EDGES[:-1])), "`edges` must rise strictly from 0 to Infinity"),
    (stops_doc(edges=[0.0, 0.5, 0.2, math.inf]), "`edges` must rise strictly"),
    (stops_doc(width=0), "`width` must be an integer"),
    (stops_doc(width=48.0), "`width` must be an integer"),
    (stops_doc(threshold=-0.1), "`threshold` must be a finite number >= 0"),
    (stops_doc(threshold=math.inf), "`threshold` must be a finite number >= 0"),
    (stops_doc(threshold=True), "`threshold` must be a number"),
    (stops_doc(power=math.nan), "`power` must be a number"),
    (stops_doc(strong="small"), "names another pair"),
    (stops_doc(strong="mid"), "must be two tier names"),
    (stops_doc(quality=1.2), "`quality` must be a share within [0, 1]"),
    (stops_doc(quality="high"), "`quality` must be a number"),
    ({"mid->full": {"cheap": "mid", "strong": "full"}}, "missing edges, hazard, power, quality, threshold, width"),
])
def test_a_malformed_stop_refuses_the_artifact(tmp_path: Path, stops: object, message: str) -> None:
    with pytest.raises(ValueError, match="cascade") as err:
        load_difficulty_model(artifact_with(tmp_path, stops), embedder=HashEmbedder())
    assert message in str(err.value)


def test_a_stop_needs_two_alternatives_per_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`top_logprobs` must be at least 2"):
        load_difficulty_model(artifact_with(tmp_path, stops_doc(), top_logprobs=1), embedder=HashEmbedder())
