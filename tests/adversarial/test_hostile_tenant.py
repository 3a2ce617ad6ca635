"""No single request may hurt another tenant (issue 16): the real gateway with real SmolLM2 engines, a
victim in a loop, an attacker repeating each class of hostile request (bench/hostile_tenant.py holds them;
its figures go to BENCHMARKS.md). For each: every victim request succeeds, the victim's p95 stays within
3x of its p95 alone (plus a small absolute slack for this noisy 2-core machine), and the attacker gets
4xx or 200, never a 5xx. A second victim takes the cache's path (temperature 0, a new question each time)
against the attacks on what that path shares. Afterwards every tier answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.hostile_tenant import Attack, Phase, Served, all_tiers_answer, attacks, cache_attacks, run_phase, served
from tests.conftest import MODELS_DIR

pytestmark = pytest.mark.model
VICTIM_REQUESTS = 12
SLACK_S = 0.25


@pytest.fixture(scope="module")
def gateway(prepared_models: object) -> Iterator[Served]:
    with served(MODELS_DIR) as s:
        run_phase(s, "warm-up", 4)
        yield s


@pytest.fixture(scope="module")
def alone(gateway: Served) -> Phase:
    phase = run_phase(gateway, "victim alone", VICTIM_REQUESTS)
    assert not phase.victim_failed, phase.victim_failed
    return phase


ATTACKS = ["regex-bait", "long-word-auto", "seeds", "temperatures", "stops", "many-messages", "nested-json",
           "wide-content-parts", "unsupported-fields", "refused-flood", "schema-fails-mid-answer",
           "schema-fails-each-one-new", "allof-of-anyofs", "tools-not-offered", "nan-in-wide-body", "header-flood"]


@pytest.mark.parametrize("index", range(len(ATTACKS)), ids=ATTACKS)
def test_an_attack_does_not_reach_the_victim(gateway: Served, alone: Phase, index: int) -> None:
    assert len(attacks(gateway)) == len(ATTACKS)  # one id for each of the bench's attacks, in its order
    attack = attacks(gateway)[index]
    check(attack, run_phase(gateway, attack.name, VICTIM_REQUESTS, attack), alone)


@pytest.fixture(scope="module")
def cache_alone(gateway: Served) -> Phase:
    phase = run_phase(gateway, "cache's victim alone", VICTIM_REQUESTS, cache=True)
    assert not phase.victim_failed, phase.victim_failed
    return phase


@pytest.mark.parametrize("index", range(4), ids=["embeddings-2048", "cannot-fit-after-cached", "too-long-auto",
                                                 "over-budget-new-questions"])
def test_an_attack_does_not_reach_the_cache_victim(gateway: Served, cache_alone: Phase, index: int) -> None:
    attack = cache_attacks(gateway)[index]
    check(attack, run_phase(gateway, attack.name, VICTIM_REQUESTS, attack, cache=True), cache_alone)


def check(attack: Attack, phase: Phase, alone: Phase) -> None:
    assert not phase.victim_failed, phase.victim_failed
    assert phase.attacker, "the attacker sent nothing"
    assert all(code == 200 or 400 <= code < 500 for code in phase.attacker), dict(phase.attacker)
    if attack.refused:
        assert any(400 <= code < 500 for code in phase.attacker), dict(phase.attacker)  # the hostile part refused
    assert phase.p(0.95) <= 3 * alone.p(0.95) + SLACK_S, (phase.p(0.95), alone.p(0.95))


def test_afterwards_every_tier_answers(gateway: Served, alone: Phase) -> None:
    assert all_tiers_answer(gateway) == {"mid": 200, "full": 200}
