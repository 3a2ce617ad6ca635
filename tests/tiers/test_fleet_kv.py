"""What the ladder's `kv_utilisation` reads from the engines' /health (tiers/fleet.py max_kv_utilisation)."""

from __future__ import annotations

from pathlib import Path

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

ROOT = Path(__file__).resolve().parents[2]


def fleet_of_two() -> Fleet:
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": {
        "backend": "openai", "model": "m", "urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "price_per_1k_input": "0", "price_per_1k_output": "0", "hardware_cost_per_hour": "0", "context_limit": 1024}}})
    return Fleet(catalogue, TierClient(), models_dir=ROOT, log_dir=ROOT)


def test_the_ladder_reads_the_kv_cache_without_the_tenant_holding_most_of_it() -> None:
    fleet = fleet_of_two()
    first, second = fleet.replicas["mid"]
    first.healthy = second.healthy = True
    first.stats = {"kv_utilisation": 0.98, "kv_utilisation_others": 0.10}  # one tenant's long prompts fill it
    second.stats = {"kv_utilisation": 0.40, "kv_utilisation_others": 0.35}
    assert fleet.max_kv_utilisation() == 0.35
    second.stats = {"kv_utilisation": 0.60}  # an engine that does not tell counts whole
    assert fleet.max_kv_utilisation() == 0.60
    second.healthy = False
    assert fleet.max_kv_utilisation() == 0.10
