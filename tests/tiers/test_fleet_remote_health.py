"""A remote tier's health check against a server that runs one request at a time: a check left unanswered while
our own requests run there, and get chunks from it, does not take a busy replica out (llama-cpp-python holds
/v1/models behind its generation). One unanswered with nothing of ours there, or with our requests getting
nothing (a hung server), or a refused one, does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tiers.catalogue import TierCatalogue
from tiers.errors import TierError, UpstreamTimedOut, UpstreamUnreachable
from tiers.fleet import BUSY_GRACE_S, Fleet
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


@pytest.mark.parametrize(("failure", "inflight", "heard_s_ago", "after"), [
    (SILENT, 1, 0.0, "ready"),                       # busy with our request, which hears from it: left as it was
    (SILENT, 0, 0.0, "down"),                        # nothing of ours there: silent is down
    (SILENT, 1, None, "down"),                       # our request has heard nothing from it at all
    (SILENT, 1, BUSY_GRACE_S + 1, "down"),           # nor lately: hung, however much of ours waits there
    (UpstreamUnreachable("connection refused"), 1, 0.0, "down"),  # refused: down whatever is in flight
])
def test_an_unanswered_check_leaves_a_replica_in_only_while_our_requests_hear_from_it(
        tmp_path: Path, failure: TierError, inflight: int, heard_s_ago: float | None, after: str) -> None:
    client = CheckAnswers()
    fleet, rep = ready_fleet(tmp_path, client)
    rep.inflight = inflight
    rep.last_heard = None if heard_s_ago is None else time.monotonic() - heard_s_ago
    client.failure = failure
    check(fleet)
    assert rep.status == after and rep.healthy == (after == "ready")
    if after == "down":
        assert str(failure) in rep.reason
    # once its requests are over, a check that is still unanswered takes it out
    rep.inflight = 0
    client.failure = SILENT
    check(fleet)
    assert rep.status == "down"


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
