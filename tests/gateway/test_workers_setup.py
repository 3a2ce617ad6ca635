"""What `tiergate serve --workers N` decides before a worker starts: refusing without Redis, each worker's share of a
tier's dispatch slots, and the cores the gateway keeps for its workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import tier_capacity
from gateway.cli.main import cli
from gateway.settings import Settings
from tiers.catalogue import TierSpec
from tiers.fleet import host_core_budget


def remote(urls: int, max_concurrency: int | None = None) -> TierSpec:
    return TierSpec(name="mid", backend="openai", model="m", urls=[f"http://127.0.0.1:{9000 + i}" for i in range(urls)],
                    price_per_1k_input="0", price_per_1k_output="0", hardware_cost_per_hour="0", context_limit=4096,
                    max_concurrency=max_concurrency)


def test_several_workers_without_redis_are_refused_before_anything_starts(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_REDIS_URL", raising=False)
    data_dir = tmp_path / "data"
    r = CliRunner().invoke(cli, ["serve", "--workers", "2", "--data-dir", str(data_dir)])
    assert r.exit_code == 2  # a usage error
    assert "TIERGATE_REDIS_URL" in r.output and "2 times every limit" in r.output
    assert not data_dir.exists()  # no model fetched, no key made, no port taken


@pytest.mark.parametrize(("workers", "urls", "max_concurrency", "slots"), [
    (1, 2, 8, 16),
    (2, 2, 8, 8),
    (3, 2, 8, 6),  # 16 slots over 3 workers: 6 each, rounded up (18 in all: the upstream queues 2 more)
    (4, 1, 2, 1),  # every worker keeps at least one
    (2, 1, None, 32),  # remote_max_concurrency (64) per replica, halved
])
def test_each_worker_gets_its_share_of_a_tiers_dispatch_slots(workers: int, urls: int, max_concurrency: int | None,
                                                                slots: int) -> None:
    assert tier_capacity(remote(urls, max_concurrency), Settings(workers=workers)) == slots


@pytest.mark.parametrize(("env", "workers", "cores", "budget"), [
    ({}, 1, [0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]),
    ({}, 4, [0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7]),  # a core for each worker
    ({}, 2, [0, 1], [1]),  # the engines always keep one
    ({"TIERGATE_GATEWAY_CORES": "2"}, 4, [0, 1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]),  # the setting decides
])
def test_the_gateway_keeps_a_core_per_worker_unless_told_otherwise(env: dict[str, str], workers: int, cores: list[int],
                                                                   budget: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIERGATE_GATEWAY_CORES", "TIERGATE_CORE_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_core_budget(cores, workers=workers) == budget
