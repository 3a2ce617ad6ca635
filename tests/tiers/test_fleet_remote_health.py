"""A remote tier's health check against a server that runs one request at a time: a check left unanswered while
our own requests run there does not take a busy replica out (llama-cpp-python holds /v1/models behind its
generation); one unanswered with nothing of ours there, or refused, does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tiers.catalogue import TierCatalogue
from tiers.errors import TierError, UpstreamTimedOut, UpstreamUnreachable
from tiers.fleet import Fleet

PRICES: dict[str, Any] = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                          "hardware_cost_per_hour": "1", "context_limit": 4096}


class CheckAnswers:
    """A client whose /v1/models answers, or fails with `failure` once it is set (a fake for the fleet's logic)."""

    def __init__(self) -> None:
        self.failure: TierError | None = None

    async def get_json(self, url: str, *, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
        if self.failure is not None:
            raise self.failure
        return {"data": [{"id": "stub-mid"}]}


@pytest.mark.parametrize(("failure", "inflight", "after"), [
    (UpstreamTimedOut("no answer in 3.0s"), 1, "ready"),   # busy with our request: left as it was
    (UpstreamTimedOut("no answer in 3.0s"), 0, "down"),    # nothing of ours there: silent is down
    (UpstreamUnreachable("connection refused"), 1, "down"),  # refused: down whatever is in flight
])
def test_an_unanswered_check_takes_a_replica_out_only_when_nothing_of_ours_runs_there(
        tmp_path: Path, failure: TierError, inflight: int, after: str) -> None:
    cat = TierCatalogue.model_validate({"tiers": {
        "mid": {"backend": "openai", "model": "stub-mid", "urls": ["http://127.0.0.1:9"]} | PRICES}})
    client = CheckAnswers()
    fleet = Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, core_budget=None)  # type: ignore[arg-type]
    spec = cat.tiers["mid"]
    (rep,) = fleet.replicas["mid"]
    asyncio.run(fleet._check_remote(spec))
    assert rep.status == "ready"
    rep.inflight = inflight
    client.failure = failure
    asyncio.run(fleet._check_remote(spec))
    assert rep.status == after and rep.healthy == (after == "ready")
    if after == "down":
        assert str(failure) in rep.reason
    # once its requests are over, a check that is still unanswered takes it out
    rep.inflight = 0
    client.failure = UpstreamTimedOut("no answer in 3.0s")
    asyncio.run(fleet._check_remote(spec))
    assert rep.status == "down"


def test_a_check_that_began_while_a_request_ran_there_is_not_an_outage_when_that_request_ends_first(
        tmp_path: Path) -> None:
    # the server answers nothing until its one request ends; the request ends, then the check gives up
    cat = TierCatalogue.model_validate({"tiers": {
        "mid": {"backend": "openai", "model": "stub-mid", "urls": ["http://127.0.0.1:9"]} | PRICES}})
    client = CheckAnswers()
    fleet = Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, core_budget=None)  # type: ignore[arg-type]
    (rep,) = fleet.replicas["mid"]
    asyncio.run(fleet._check_remote(cat.tiers["mid"]))
    rep.inflight = 1

    class RequestEndsFirst(CheckAnswers):
        async def get_json(self, url: str, *, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
            rep.inflight = 0
            raise UpstreamTimedOut("no answer in 3.0s")

    fleet.client = RequestEndsFirst()  # type: ignore[assignment]
    asyncio.run(fleet._check_remote(cat.tiers["mid"]))
    assert rep.status == "ready"
