"""A remote tier's health checks: a refused one takes a replica out at once; unanswered ones do at the second in a
row (a loaded host missing one 3 s answer is not an outage), and not at all while our own requests run there and
get chunks from it (a server that runs one request at a time, as llama-cpp-python does, holds /v1/models behind
its generation). A hung server, whose requests get nothing, is taken out however much of ours waits there."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tiers.catalogue import TierCatalogue
from tiers.errors import TierError, UpstreamTimedOut, UpstreamUnreachable
from tiers.fleet import BUSY_GRACE_S, UNANSWERED_TO_DOWN, Fleet
from tiers.replica import Replica

PRICES: dict[str, Any] = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                          "hardware_cost_per_hour": "1", "context_limit": 4096}
CATALOGUE = {"tiers": {"mid": {"backend": "openai", "model": "stub-mid", "urls": ["http://127.0.0.1:9"]} | PRICES}}
SILENT = UpstreamTimedOut("no answer in 3.0s")


class CheckAnswers:
    """A client whose /v1/models answers, or fails with `failure` once it is set (a fake for the fleet's logic)."""

    def __init__(self) -> None:
        self.failure: TierError | None = None

    async def get_json(self, url: str, *, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
        if self.failure is not None:
            raise self.failure
        return {"data": [{"id": "stub-mid"}]}


def ready_fleet(tmp_path: Path, client: CheckAnswers) -> tuple[Fleet, Replica]:
    """A fleet whose one remote replica passed its first check."""
    fleet = Fleet(TierCatalogue.model_validate(CATALOGUE), client,  # type: ignore[arg-type]
                  models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
    check(fleet)
    (rep,) = fleet.replicas["mid"]
    assert rep.status == "ready"
    return fleet, rep


def check(fleet: Fleet) -> None:
    asyncio.run(fleet._check_remote(fleet.catalogue.tiers["mid"]))


LONG_AGO = BUSY_GRACE_S + 1


@pytest.mark.parametrize(("failure", "inflight", "heard_s_ago", "asked_s_ago", "checks_to_down"), [
    (SILENT, 1, 0.0, LONG_AGO, None),          # busy with our request, which hears from it: left as it was
    (SILENT, 1, None, 0.0, None),              # asked just now, nothing heard yet (a long prompt read): left
    (SILENT, 0, 0.0, 0.0, UNANSWERED_TO_DOWN),  # nothing of ours there: silent, twice in a row, is down
    (SILENT, 1, None, LONG_AGO, UNANSWERED_TO_DOWN),  # asked long ago and never heard from: hung
    (SILENT, 1, LONG_AGO, LONG_AGO, UNANSWERED_TO_DOWN),  # nor lately, however much of ours waits there
    (UpstreamUnreachable("connection refused"), 1, 0.0, 0.0, 1),  # refused: down at once, whatever is in flight
])
def test_unanswered_checks_take_a_replica_out_only_in_a_row_and_not_while_it_is_busy_lately(
        tmp_path: Path, failure: TierError, inflight: int, heard_s_ago: float | None, asked_s_ago: float,
        checks_to_down: int | None) -> None:
    assert UNANSWERED_TO_DOWN == 2
    client = CheckAnswers()
    fleet, rep = ready_fleet(tmp_path, client)
    rep.inflight = inflight
    rep.last_heard = None if heard_s_ago is None else time.monotonic() - heard_s_ago
    rep.busy_since = time.monotonic() - asked_s_ago
    client.failure = failure
    statuses = []
    for _ in range(3):
        check(fleet)
        statuses.append(rep.status)
    down_at = statuses.index("down") + 1 if "down" in statuses else None
    assert down_at == checks_to_down, statuses
    if checks_to_down is not None:
        assert str(failure) in rep.reason and not rep.healthy
    # once its requests are over, unanswered checks take it out
    rep.inflight = 0
    client.failure = SILENT
    for _ in range(UNANSWERED_TO_DOWN):
        check(fleet)
    assert rep.status == "down"


def test_an_answered_check_starts_the_count_again_and_a_replica_not_yet_up_is_out_at_once(tmp_path: Path) -> None:
    client = CheckAnswers()
    fleet, rep = ready_fleet(tmp_path, client)
    for answer in (SILENT, None, SILENT, None):  # never two unanswered in a row
        client.failure = answer
        check(fleet)
        assert rep.status == "ready"
    # so does one forgiven as busy: an idle strike, a busy check, an idle strike is not two in a row
    client.failure = SILENT
    check(fleet)
    rep.inflight, rep.last_heard = 1, time.monotonic()
    check(fleet)
    rep.inflight = 0
    check(fleet)
    assert rep.status == "ready"
    check(fleet)
    assert rep.status == "down"
    # a replica starting (never up): its first unanswered check is enough to keep it out
    starting = Fleet(TierCatalogue.model_validate(CATALOGUE), client,  # type: ignore[arg-type]
                     models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
    client.failure = SILENT
    check(starting)
    assert starting.replicas["mid"][0].status == "down"


def test_a_check_that_began_while_a_request_ran_there_is_not_an_outage_when_that_request_ends_first(
        tmp_path: Path) -> None:
    # the server answers nothing until its one request ends; the request ends, then the check gives up
    client = CheckAnswers()
    fleet, rep = ready_fleet(tmp_path, client)
    rep.inflight, rep.last_heard = 1, time.monotonic()

    class RequestEndsFirst(CheckAnswers):
        async def get_json(self, url: str, *, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
            rep.inflight = 0
            raise SILENT

    fleet.client = RequestEndsFirst()  # type: ignore[assignment]
    check(fleet)
    assert rep.status == "ready"
