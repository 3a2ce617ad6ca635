"""A fleet checks its remote tiers once before it returns from `start`, so a gateway process (a worker that has
just started or restarted) never serves a request while a tier that is up still looks down to it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.stubs import ServerThread, StubState, free_port, stub_app
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

PRICES: dict[str, Any] = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                          "hardware_cost_per_hour": "1", "context_limit": 4096}


def test_remote_tiers_are_checked_before_start_returns(tmp_path: Path) -> None:
    server = ServerThread(stub_app(StubState())).start()
    try:
        cat = TierCatalogue.model_validate({"tiers": {
            "mid": {"backend": "openai", "model": "stub-mid", "urls": [server.url]} | PRICES,
            "full": {"backend": "openai", "model": "stub-full", "urls": [f"http://127.0.0.1:{free_port()}"]} | PRICES,
        }})

        async def started() -> dict[str, str]:
            client = TierClient()
            fleet = Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
            try:
                await fleet.start()
                return {name: reps[0].status for name, reps in fleet.replicas.items()}
            finally:
                await fleet.stop()
                await client.aclose()

        assert asyncio.run(started()) == {"mid": "ready", "full": "down"}
    finally:
        server.stop()
