"""bench/cache_bound.py end to end on a few held-out cases (real MiniLM, two passes): every arm and pass has its
rows, every kind its column, and the figures are shares, thresholds and counts that can be true. Nothing is timed.
Also: the held-out sets keep their hash split (a held-out question is never a training one)."""

from __future__ import annotations

import re

import pytest

from bench import cache_bound
from bench.near_miss_sets import KINDS, build, is_training_gptcache_origin, is_training_question

ARGS = ["--per-kind", "3", "--rule-paraphrases", "6", "--gptcache-pairs", "12", "--passes", "2", "--window", "10",
        "--show-false-hits", "unit", "--show-false-hits", "antonym", "--show-arm", "static", "--show-arm", "bound 5%"]


@pytest.fixture(scope="module")
def report() -> str:
    return cache_bound.main(ARGS)


def rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the table under `heading`, as cells."""
    section = text.split(heading, 1)[1].split("\n\n", 2)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def share(cell: str) -> float:
    found = re.match(r"(\d+(?:\.\d+)?)%", cell)
    assert found is not None, cell
    return float(found.group(1))


def test_every_arm_and_pass_has_a_row_with_possible_figures(report: str) -> None:
    table = rows(report, "### Per pass")
    assert [(r[0], r[1]) for r in table] == [(arm, p) for arm in cache_bound.ARMS for p in ("1", "2", "2-N")]
    for arm, _, lookups, served, wrong, edits, _, recall, precision, threshold, labels, near, shadow in table:
        assert int(lookups) == 3 * len(KINDS) + 6 + 12
        for cell in (served, wrong, edits, recall):
            assert 0 <= share(cell) <= 100
        assert precision == "n/a" or 0 <= float(precision) <= 1
        assert threshold.startswith("0.800") or threshold.startswith("none") or 0.7 <= float(threshold) <= 1
        assert int(labels) >= 0 and int(near) >= 0 and int(shadow) >= 0
        if arm == "static":  # no bound: nothing is labelled
            assert (labels, near, shadow) == ("0", "0", "0")


def test_the_per_kind_table_has_every_kind(report: str) -> None:
    head = report.split("### Edits served, per kind", 1)[1].split("\n\n", 2)[1].splitlines()[0]
    assert [c.strip() for c in head.strip("|").split("|")] == ["arm", "pass", *KINDS, "all edits"]
    for row in rows(report, "### Edits served, per kind"):
        assert all(0 <= share(cell) <= 100 for cell in row[2:])


def test_the_targets_table_judges_every_arm(report: str) -> None:
    table = rows(report, "### Against the issue's targets")
    assert [r[0] for r in table] == list(cache_bound.ARMS)
    assert "CPU:" in report and "Learned threshold after every 10 lookups" in report


def test_the_wrong_hits_asked_for_are_listed(report: str) -> None:
    """One list per arm and kind asked for; each wrong hit served in one pass or both, and an edit is never listed
    as served its own text."""
    for arm in ("static", "bound 5%"):
        for kind in ("unit", "antonym"):
            section = report.split(f"### Wrong hits served, {arm}, {kind}: ", 1)[1].split("\n### ", 1)[0]
            listed = int(section.split(" ", 1)[0])
            lines = [line for line in section.splitlines() if line.startswith("- ")]
            assert len(lines) == listed
            for line in lines:
                found = re.match(r"- ([12])x: (.+)  <-  (.+)$", line)
                assert found is not None, line
                assert found.group(2) != found.group(3)
    assert "### Wrong hits served, static + meaning" not in report


def test_the_held_out_sets_never_hold_a_training_question() -> None:
    cases = build(per_kind=5, num_rule_paraphrases=5)
    assert {c.kind for c in cases} >= set(KINDS)
    for c in cases:
        held_out = not is_training_gptcache_origin(c.original) if c.kind == "paraphrase:gptcache" \
            else not is_training_question(c.original)
        assert held_out, c
