"""Co-located engines share one core budget: each local replica gets disjoint cores (or says which it shares),
its engine runs pinned there with as many threads as it has cores, and tiers on the same cores form one
hardware group. Pure planning first (no engine runs), then one real child checked for the affinity it got."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import SHARED_HOST, Fleet, host_core_budget
from tiers.replica import Replica
from tiers.supervisor import CoreShare, EngineProcess

STUB_ENGINE = Path(__file__).resolve().parent / "stub_engine.py"
PRICES = {"small": "0.0001", "mid": "0.0002", "full": "0.0006"}


def catalogue(*tiers: str, replicas: int = 1, cores: dict[str, float] | None = None) -> TierCatalogue:
    """Local tiers (cheapest to dearest: small, mid, full), each with `replicas` engines."""
    return TierCatalogue(tiers={name: {
        "backend": "local", "model": "smollm2-135m-instruct", "replicas": replicas, "context_limit": 1024,
        "price_per_1k_input": PRICES[name], "price_per_1k_output": PRICES[name], "hardware_cost_per_hour": "0",
        **({"cores": cores[name]} if cores and name in cores else {})} for name in tiers})


def fleet(cat: TierCatalogue, budget: list[int] | None, tmp_path: Path) -> Fleet:
    return Fleet(cat, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=budget)


def launches(f: Fleet) -> dict[str, tuple[tuple[int, ...], str, str, tuple[str, ...]]]:
    """Each replica's (affinity, --threads flag, OMP_NUM_THREADS, replicas it shares cores with)."""
    out = {}
    for engine in f._engines:
        cmd, env = engine.command(9000), engine.env()
        assert engine.cores is not None and env["MKL_NUM_THREADS"] == env["OMP_NUM_THREADS"]
        out[f"{engine.spec.name}/{engine.replica.index}"] = (
            engine.cores.cores, cmd[cmd.index("--threads") + 1], env["OMP_NUM_THREADS"], engine.cores.shared_with)
    return out


@pytest.mark.parametrize(("tiers", "cores", "expected"), [
    (["full"], [0, 1], {"full/0": ((0, 1), "2", "2", ())}),
    (["full"], [0, 1, 2, 3], {"full/0": ((0, 1, 2, 3), "4", "4", ())}),
    (["mid", "full"], [0, 1], {"full/0": ((0,), "1", "1", ()), "mid/0": ((1,), "1", "1", ())}),
    (["mid", "full"], [0, 1, 2, 3], {"full/0": ((0, 1), "2", "2", ()), "mid/0": ((2, 3), "2", "2", ())}),
    # more replicas than cores: the dearest keeps a core to itself, the cheaper two share one, one thread each
    (["small", "mid", "full"], [0, 1], {"full/0": ((0,), "1", "1", ()), "mid/0": ((1,), "1", "1", ("small/0",)),
                                        "small/0": ((1,), "1", "1", ("mid/0",))}),
    # what rounding leaves over goes to the dearest
    (["small", "mid", "full"], [0, 1, 2, 3], {"full/0": ((0, 1), "2", "2", ()), "mid/0": ((2,), "1", "1", ()),
                                              "small/0": ((3,), "1", "1", ())}),
])
def test_each_replica_gets_its_own_cores_and_threads_to_match(tiers: list[str], cores: list[int],
                                                              expected: dict[str, object], tmp_path: Path) -> None:
    f = fleet(catalogue(*tiers), cores, tmp_path)
    assert launches(f) == expected
    used = [c for share in f.core_shares.values() for c in share.cores]
    assert sorted(set(used)) == cores  # every core in the budget goes to some engine


def test_replicas_of_one_tier_split_too_and_weights_skew_the_split(tmp_path: Path) -> None:
    two_mids = launches(fleet(catalogue("mid", replicas=2), [0, 1, 2, 3], tmp_path))
    assert two_mids == {"mid/0": ((0, 1), "2", "2", ()), "mid/1": ((2, 3), "2", "2", ())}
    heavy_full = launches(fleet(catalogue("mid", "full", cores={"full": 3}), [0, 1, 2, 3], tmp_path))
    assert heavy_full == {"full/0": ((0, 1, 2), "3", "3", ()), "mid/0": ((3,), "1", "1", ())}
    # a weight can never take a replica's last core away
    tiny_mid = launches(fleet(catalogue("mid", "full", cores={"full": 100}), [0, 1], tmp_path))
    assert tiny_mid["mid/0"][0] == (1,)


def test_tiers_on_shared_cores_form_one_hardware_group(tmp_path: Path) -> None:
    apart = fleet(catalogue("mid", "full"), [0, 1], tmp_path).hardware_groups
    assert apart["mid"] != apart["full"]
    crowded = fleet(catalogue("small", "mid", "full"), [0, 1], tmp_path)
    assert crowded.hardware_groups == {"full": "cpu:full", "mid": "cpu:mid+small", "small": "cpu:mid+small"}
    status = crowded.status()  # what /health's details show an admin
    assert status["mid"]["hardware_group"] == "cpu:mid+small"
    mid = status["mid"]["replicas"][0]
    assert (mid["cores"], mid["threads"], mid["shares_cores_with"]) == ([1], 1, ["small/0"])
    assert status["full"]["replicas"][0]["shares_cores_with"] == []


def test_without_a_budget_engines_run_unpinned_and_every_local_tier_shares_the_host(tmp_path: Path) -> None:
    f = fleet(catalogue("mid", "full"), None, tmp_path)
    for engine in f._engines:
        assert engine.cores is None and "--threads" not in engine.command(9000)
        assert "OMP_NUM_THREADS" not in engine.env() or engine.env()["OMP_NUM_THREADS"] == os.environ.get(
            "OMP_NUM_THREADS")
    assert f.hardware_groups == {"mid": SHARED_HOST, "full": SHARED_HOST}
    assert f.status()["full"]["replicas"][0]["cores"] == "all (core budget off)"


def test_a_tiers_own_thread_count_wins_over_its_share(tmp_path: Path) -> None:
    cat = catalogue("full")
    cat.tiers["full"].threads = 1
    (engine,) = fleet(cat, [0, 1], tmp_path)._engines
    cmd = engine.command(9000)
    assert cmd[cmd.index("--threads") + 1] == "1" and engine.env()["OMP_NUM_THREADS"] == "1"
    assert engine.cores == CoreShare((0, 1), 2)  # still pinned to its share


@pytest.mark.parametrize(("env", "cores", "budget"), [
    ({}, [0, 1], [0, 1]),  # below 4 CPUs the gateway keeps none: a core of 2 is half the engines' capacity
    ({}, [0, 1, 2, 3], [1, 2, 3]),  # from 4 up it keeps one, so its event loop never waits on a spinning engine
    ({"TIERGATE_GATEWAY_CORES": "0"}, [0, 1, 2, 3], [0, 1, 2, 3]),
    ({"TIERGATE_GATEWAY_CORES": "1"}, [0, 1], [1]),
    ({"TIERGATE_GATEWAY_CORES": "8"}, [4, 5], [5]),  # the engines always keep one
    ({"TIERGATE_CORE_BUDGET": "off"}, [0, 1], None),
])
def test_the_host_budget_is_the_gateways_cores_less_its_reserve(env: dict[str, str], cores: list[int],
                                                                 budget: list[int] | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIERGATE_GATEWAY_CORES", "TIERGATE_CORE_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_core_budget(cores) == budget


class StubEngineProcess(EngineProcess):
    def command(self, port: int) -> list[str]:
        return [sys.executable, str(STUB_ENGINE), str(port)]


async def test_a_spawned_engine_runs_on_the_cores_it_was_given(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    core = max(os.sched_getaffinity(0))  # one of ours, and a strict subset wherever we have two or more
    spec = catalogue("mid").tiers["mid"].model_copy(update={"model": str(model_dir)})
    client = TierClient()
    replica = Replica("mid", 0)
    proc = StubEngineProcess(spec, replica, models_dir=tmp_path, log_dir=tmp_path / "logs", client=client,
                             start_timeout_s=30, cores=CoreShare((core,), 1))
    task = asyncio.create_task(proc.run())
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while not replica.healthy:
            assert asyncio.get_running_loop().time() < deadline, "the stub engine never answered"
            await asyncio.sleep(0.05)
        pid = proc.proc.pid  # type: ignore[union-attr]
        assert os.sched_getaffinity(pid) == {core}
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert environ["OMP_NUM_THREADS"] == "1" and environ["MKL_NUM_THREADS"] == "1"
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()
