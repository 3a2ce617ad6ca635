"""OwnerLanes (cache/owner_lanes.py): jobs per owner, first in first out, the owners in turns."""

from __future__ import annotations

import pytest

from cache.owner_lanes import OwnerLanes


def take_all(lanes: OwnerLanes[str]) -> list[str]:
    return [lanes.take() for _ in range(len(lanes))]


def test_owners_take_turns_in_the_order_they_first_queued_each_owners_jobs_in_order() -> None:
    lanes: OwnerLanes[str] = OwnerLanes()
    for job in ("a0", "a1", "a2", "a3", "b0", "c0", "c1", "b1"):
        assert lanes.add(job[0], job) is None
    assert len(lanes) == 8
    assert lanes.owners() == ["a", "b", "c"]
    assert take_all(lanes) == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "a3"]
    assert len(lanes) == 0 and not lanes


def test_an_owner_that_queues_again_after_its_turn_waits_behind_the_others() -> None:
    lanes: OwnerLanes[str] = OwnerLanes()
    lanes.add("a", "a0")
    lanes.add("a", "a1")
    lanes.add("b", "b0")
    assert lanes.take() == "a0"
    lanes.add("c", "c0")  # a new owner goes last: behind a, sent back after its turn
    lanes.add("a", "a2")
    assert take_all(lanes) == ["b0", "a1", "c0", "a2"]


def test_an_empty_lane_is_forgotten_and_a_later_job_of_its_owner_queues_last() -> None:
    lanes: OwnerLanes[str] = OwnerLanes()
    lanes.add("a", "a0")
    lanes.add("b", "b0")
    lanes.add("b", "b1")
    assert lanes.take() == "a0"
    assert lanes.owners() == ["b"] and lanes.queued("a") == 0
    assert lanes.take() == "b0"
    lanes.add("a", "a1")
    assert lanes.owners() == ["b", "a"]
    assert take_all(lanes) == ["b1", "a1"]
    assert lanes.owners() == []
    with pytest.raises(IndexError):
        lanes.take()


def test_a_full_lane_hands_back_its_oldest_job_and_the_others_keep_theirs() -> None:
    lanes: OwnerLanes[str] = OwnerLanes(per_owner=2)
    assert lanes.add("a", "a0") is None
    assert lanes.add("a", "a1") is None
    assert lanes.add("b", "b0") is None
    assert lanes.add("a", "a2") == "a0"
    assert lanes.add("a", "a3") == "a1"
    assert lanes.queued("a") == 2 and lanes.queued("b") == 1 and len(lanes) == 3
    assert lanes.take() == "a2"
    assert lanes.add("a", "a4") is None  # the job taken made room
    assert take_all(lanes) == ["b0", "a3", "a4"]


def test_drain_gives_every_job_and_empties_the_lanes() -> None:
    lanes: OwnerLanes[str] = OwnerLanes()
    for job in ("a0", "b0", "a1"):
        lanes.add(job[0], job)
    assert lanes.drain() == ["a0", "a1", "b0"]
    assert len(lanes) == 0 and lanes.owners() == [] and lanes.queued("a") == 0
    lanes.add("b", "b1")
    assert take_all(lanes) == ["b1"]


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        OwnerLanes(per_owner=0)
