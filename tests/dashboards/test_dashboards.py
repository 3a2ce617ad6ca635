"""Grafana dashboards and alert rules use only metrics the gateway exports; every exported metric is
documented; the rules pass `promtool check rules` (Debian's prometheus package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from cache.error_bound import TenantBounds
from cache.results import CacheStats
from gateway.cache_bound_metrics import CacheBoundCollector
from gateway.metrics import GatewayMetrics
from gateway.pipeline.cache_check import CacheChecks
from gateway.redis_eviction_watch import EvictionCollector, RedisEvictionWatch
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
NAME = re.compile(r"\btiergate_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> tuple[set[str], set[str]]:
    """(sample names a scrape can contain, metric family names)."""
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": {
        "backend": "openai", "model": "m", "urls": ["http://127.0.0.1:1"], "price_per_1k_input": "0",
        "price_per_1k_output": "0", "hardware_cost_per_hour": "0", "context_limit": 1024}}})
    fleet = Fleet(catalogue, TierClient(), models_dir=ROOT, log_dir=ROOT)
    fleet.replicas["mid"][0].stats = {"kv_utilisation": 0.5, "tokens_per_s": 10, "num_running": 1, "num_waiting": 0}
    metrics = GatewayMetrics(fleet)
    metrics.ladder = type("L", (), {"level": 0, "in_sync": True})()
    # what the error bound, the checks and the index's state export
    cache = SimpleNamespace(bounds=TenantBounds(), stats=CacheStats(), loaded=True)
    cache.bounds.get("acme", 0.01, 0.8)
    metrics.registry.register(CacheBoundCollector(cache))  # type: ignore[arg-type]
    CacheChecks(cache=cache, caller=None, registry=metrics.registry)  # type: ignore[arg-type]
    # the Redis eviction watch's gauges (with TIERGATE_REDIS_URL; the watch is not started, nothing connects)
    metrics.registry.register(EvictionCollector(RedisEvictionWatch("redis://127.0.0.1:1", every_s=30,
                                                                   allow_eviction=False)))
    samples, families = set(), set()
    for family in metrics.registry.collect():
        families.add(family.name)
        samples |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    return samples, families


def used() -> dict[str, set[str]]:
    out = {}
    for f in DASHBOARDS.glob("*.json"):
        board = json.loads(f.read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        exprs += [a["expr"] for a in board.get("annotations", {}).get("list", []) if "expr" in a]
        out[f.name] = {n for e in exprs for n in NAME.findall(e)}
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    out["alerts.yml"] = {n for g in rules["groups"] for r in g["rules"] for n in NAME.findall(r["expr"])}
    return out


def test_dashboards_and_rules_use_only_exported_metrics() -> None:
    samples, _ = exported()
    uses = used()
    assert uses["finance.json"] and uses["oncall.json"] and uses["alerts.yml"]
    for source, names in uses.items():
        assert names <= samples, f"{source} uses metrics the gateway does not export: {sorted(names - samples)}"


def test_every_exported_metric_is_documented() -> None:
    _, families = exported()
    documented = set(NAME.findall((DASHBOARDS / "README.md").read_text()))
    documented = {re.sub(r"_total$", "", n) for n in documented}
    missing = {f for f in families if f not in documented and not f.endswith("_created")}
    assert not missing, f"document these in dashboards/README.md: {sorted(missing)}"


def test_finance_and_oncall_cover_what_their_users_need() -> None:
    uses = used()
    assert {"tiergate_price_usd_total", "tiergate_compute_cost_usd_total", "tiergate_tokens_total",
            "tiergate_cache_savings_usd_total", "tiergate_routing_savings_usd_total"} <= uses["finance.json"]
    assert {"tiergate_degrade_level", "tiergate_queue_depth", "tiergate_refusals_total",
            "tiergate_time_to_first_token_seconds_bucket", "tiergate_tier_replicas_ready"} <= uses["oncall.json"]
    oncall = json.loads((DASHBOARDS / "oncall.json").read_text())
    assert "tiergate_degrade_level" in oncall["annotations"]["list"][0]["expr"]


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (.ci/run does it)")
    out = subprocess.run([promtool, "check", "rules", str(DASHBOARDS / "alerts.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
