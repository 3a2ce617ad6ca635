"""A model build as the server sees it: one builder per output, its progress readable while it runs, and the
budget spellings the tier catalogue accepts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from assets.builds import BudgetError, BuildInProgress, build_lock, build_progress, parse_budget, write_progress


def test_budget_parsing() -> None:
    assert parse_budget("10m") == (600.0, None)
    assert parse_budget("90s") == (90.0, None)
    assert parse_budget("1.5h") == (5400.0, None)
    assert parse_budget("500steps") == (None, 500)
    assert parse_budget("3 steps") == (None, 3)
    for bad in ("ten minutes", "0m", "-5s", "2.5steps", ""):
        with pytest.raises(BudgetError):
            parse_budget(bad)


def test_a_second_builder_is_refused_and_told_who_builds(tmp_path: Path) -> None:
    out = tmp_path / "students" / "small"
    assert build_progress(out) is None  # nothing is building
    with build_lock(out):
        with pytest.raises(BuildInProgress, match=f"process {os.getpid()}"), build_lock(out):
            pass
        assert build_progress(out) == {}  # running, no record yet
        write_progress(out, {"step": 5, "train_s": 150.0})
        assert build_progress(out) == {"step": 5, "train_s": 150.0}
    assert build_progress(out) is None  # done: a stale record is not reported
    with build_lock(out):  # and the next builder may start
        pass
