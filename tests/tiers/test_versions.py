"""Versions of a tier in tiers.yaml: each inherits the tier's fields and changes some; `serving` answers today.

A remote tier's versions point at servers of their own; a local tier's run engines of their own (model, quantization,
dtype, engine flags), every one started and kept warm by the supervisor inside the host's one core budget, each with
its own model version so that no cached answer crosses versions."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.pipeline.text_completion import parse_completion
from gateway.pipeline.tier_call import upstream_body
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.engines_file import read_published, write_document
from tiers.fleet import Fleet
from tiers.supervisor import EngineProcess
from wire.chat_request import ChatCompletionRequest

MID: dict[str, Any] = {"backend": "openai", "model": "m1", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
                       "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}


def catalogue(**mid: Any) -> TierCatalogue:
    return TierCatalogue.model_validate({"tiers": {"mid": MID | mid}})


def test_a_version_inherits_the_tier_and_the_tier_is_its_serving_version() -> None:
    c = catalogue(serving="v2", versions=[{"name": "v1"}, {"name": "v2", "model": "m2", "urls": ["http://b:1"],
                                                           "quantize": "int8"}])
    mid = c.tiers["mid"]
    assert (mid.version_name, mid.model, mid.urls, mid.quantize) == ("v2", "m2", ["http://b:1"], "int8")
    v1 = mid.variant("v1")
    assert (v1.name, v1.version_name, v1.model, v1.urls, v1.quantize) == ("mid", "v1", "m1", ["http://a:1"], None)
    assert v1.price_per_1k_output == mid.price_per_1k_output and v1.context_limit == 4096
    assert set(mid.variants) == {"v1", "v2"} and mid.variant("v2") is mid


def test_a_tier_without_versions_is_as_before() -> None:
    mid = catalogue().tiers["mid"]
    assert mid.version_name is None and mid.variants == {} and mid.model == "m1"


@pytest.mark.parametrize(("mid", "message"), [
    ({"serving": "v3", "versions": [{"name": "v1"}, {"name": "v2"}]}, "serving: 'v3' is not one of"),
    ({"versions": [{"name": "v1"}]}, "names the one answering today in `serving`"),
    ({"serving": "v1", "versions": [{"name": "v1"}, {"name": "v1", "model": "x"}]}, "duplicate name(s) v1"),
    ({"serving": "v1"}, "this tier lists none"),
    ({"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": []}]}, "version 'v2': "),
    ({"serving": "v1", "versions": [{"name": "v1", "price_per_1k_input": "1"}]}, "price_per_1k_input"),
    ({"serving": "v1", "versions": [{"name": "bad name"}]}, "name"),
    ({"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "cores": 2}]}, "version 'v2': "),
])
def test_bad_versions_are_refused_with_a_clear_error(mid: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        catalogue(**mid)
    assert message in str(exc.value)


def test_each_version_has_its_own_replicas_and_model_version(tmp_path: Path) -> None:
    c = catalogue(serving="v1", versions=[{"name": "v1"}, {"name": "v2", "urls": ["http://b:1", "http://b:2"]}])
    fleet = Fleet(c, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
    mid, v2 = c.tiers["mid"], c.tiers["mid"].variant("v2")
    assert [r.url for r in fleet.replicas_of(mid)] == ["http://a:1"]
    assert [r.url for r in fleet.replicas_of(v2)] == ["http://b:1", "http://b:2"]
    assert fleet.model_version(mid) != fleet.model_version(v2)  # the cache scope keys on it: no hit crosses versions
    for rep in fleet.replicas_of(mid) + fleet.replicas_of(v2):
        rep.mark("ready", "")
    assert fleet.pick("mid", version="v2")[0].url.startswith("http://b:")
    assert fleet.pick("mid")[0].url == "http://a:1"
    assert set(fleet.status()["mid"]["versions"]) == {"v1", "v2"}
    plain = fleet.model_version(catalogue().tiers["mid"])  # without versions: no version's name
    assert plain.startswith("openai:m1:none:auto:mid:") and "@" not in plain


# ---- versions of a local tier ----

STUB_ENGINE = Path(__file__).resolve().parent / "stub_engine.py"
LOCAL: dict[str, Any] = {"backend": "local", "model": "smollm2-135m-instruct", "quantize": "int8",
                         "price_per_1k_input": "0.0001", "price_per_1k_output": "0.0002",
                         "hardware_cost_per_hour": "0.04", "context_limit": 2048}
FULL: dict[str, Any] = LOCAL | {"quantize": None, "price_per_1k_input": "0.0003", "price_per_1k_output": "0.0006"}
V2: dict[str, Any] = {"name": "v2", "quantize": None, "dtype": "fp32", "kv_cache_dtype": "bf16", "max_num_seqs": 4}


def local(*, full: bool = False, **mid: Any) -> TierCatalogue:
    """Local tier `mid` (int8) with `mid` fields on top, and a dearer local `full` when asked."""
    tiers = {"mid": LOCAL | {"serving": "v1", "versions": [{"name": "v1"}, V2]} | mid}
    return TierCatalogue.model_validate({"tiers": tiers | ({"full": FULL} if full else {})})


def local_fleet(cat: TierCatalogue, tmp_path: Path, budget: list[int] | None = None) -> Fleet:
    return Fleet(cat, TierClient(), models_dir=tmp_path, log_dir=tmp_path / "logs", core_budget=budget)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_local_tier_takes_versions_that_change_its_engine() -> None:
    mid = local().tiers["mid"]
    v1, v2 = mid.variant("v1"), mid.variant("v2")
    assert v1 is mid and (v1.quantize, v1.dtype, v1.kv_cache_dtype, v1.max_num_seqs) == ("int8", "auto", "auto", None)
    assert (v2.name, v2.backend, v2.quantize, v2.dtype, v2.kv_cache_dtype, v2.max_num_seqs) == \
        ("mid", "local", None, "fp32", "bf16", 4)
    assert v2.dialect == "tiergate" and v2.model == v1.model and v2.price_per_1k_output == v1.price_per_1k_output


@pytest.mark.parametrize(("field", "value"), [("urls", ["http://b:1"]), ("api_key_env", "KEY"),
                                              ("dialect", "tiergate")])
def test_a_local_version_may_not_name_a_remote_server(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        local(versions=[{"name": "v1"}, {"name": "v2", field: value}])
    assert f"version 'v2': `{field}` belong to a remote tier's version" in str(exc.value)


def test_each_local_version_has_its_own_model_version(tmp_path: Path) -> None:
    cat = local(versions=[{"name": "v1"}, {"name": "v2", "quantize": None}, {"name": "v3", "quantize": None}])
    fleet = local_fleet(cat, tmp_path)
    mid = cat.tiers["mid"]
    v1, v2, v3 = (fleet.model_version(mid.variant(v)) for v in ("v1", "v2", "v3"))
    # before any engine reports its fingerprint: the declared precision, and the version's name
    assert (v1, v2) == ("local:smollm2-135m-instruct:int8:auto@v1", "local:smollm2-135m-instruct:none:auto@v2")
    assert v3 != v2  # the same settings, two versions: still two cache scopes
    # once the engines answer /health, their own fingerprints (weights, precision, engine build) with the name
    for version, fingerprint in (("v1", "a1"), ("v2", "b2"), ("v3", "b2")):
        for rep in fleet.replicas_of(mid.variant(version)):
            rep.model_version = fingerprint
    assert [fleet.model_version(mid.variant(v)) for v in ("v1", "v2", "v3")] == ["a1@v1", "b2@v2", "b2@v3"]


def test_every_local_version_runs_engines_of_its_own(tmp_path: Path) -> None:
    fleet = local_fleet(local(replicas=2), tmp_path)
    engines = {f"{e.replica.tier}/{e.replica.index}": e for e in fleet._engines}
    assert set(engines) == {"mid/0", "mid/1", "mid@v2/0", "mid@v2/1"}
    v1, v2 = engines["mid/0"].command(9000), engines["mid@v2/1"].command(9001)
    assert (flag(v1, "--quantize"), flag(v1, "--dtype"), flag(v1, "--kv-cache-dtype")) == ("int8", "auto", None)
    assert (flag(v2, "--quantize"), flag(v2, "--dtype"), flag(v2, "--kv-cache-dtype")) == (None, "fp32", "bf16")
    assert flag(v2, "--max-num-seqs") == "4" and flag(v1, "--served-name") == flag(v2, "--served-name") == "mid"
    assert len({e.log_path for e in engines.values()}) == 4  # one log each: engine-mid@v2-1.log
    assert [r.tier for r in fleet.replicas_of(fleet.catalogue.tiers["mid"].variant("v2"))] == ["mid@v2", "mid@v2"]



def test_each_local_versions_engine_serves_the_model_the_gateway_names(tmp_path: Path) -> None:
    """Our engine refuses a `model` other than its `--served-name` (404 `model_not_found`): the name the gateway
    sends a local tier, chat or text completion, is the one every version's engine was started with."""
    fleet = local_fleet(local(replicas=2), tmp_path)
    chat = ChatCompletionRequest.model_validate({"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    text = parse_completion(b'{"model": "mid", "prompt": "once upon"}')  # /v1/completions, as the gateway carries it
    for engine in fleet._engines:
        served = flag(engine.command(9000), "--served-name")
        for req in (chat, text):
            body = upstream_body(req, engine.spec, max_tokens=4, priority=1, logprobs=False)
            assert ("prompt" in body) is (req is text)
            assert body["model"] == served == "mid", (engine.replica.tier, body)

@pytest.mark.parametrize(("budget", "cores", "expected"), [
    # more replicas than cores: `full` (the dearest) keeps its core, mid's two versions share the other
    ([0, 1], None, {"full/0": ((0,), ()), "mid/0": ((1,), ("mid@v2/0",)), "mid@v2/0": ((1,), ("mid/0",))}),
    ([0, 1, 2, 3], None, {"full/0": ((0, 1), ()), "mid/0": ((2,), ()), "mid@v2/0": ((3,), ())}),
    # a version's own `cores` weight: the candidate, given little traffic, is given less of the host
    ([0, 1, 2, 3, 4, 5], 0.5, {"full/0": ((0, 1, 2), ()), "mid/0": ((3, 4), ()), "mid@v2/0": ((5,), ())}),
])
def test_the_versions_of_a_tier_share_the_hosts_cores_never_oversubscribing_them(
        budget: list[int], cores: float | None, expected: dict[str, object], tmp_path: Path) -> None:
    v2 = V2 | ({"cores": cores} if cores is not None else {})
    fleet = local_fleet(local(full=True, versions=[{"name": "v1"}, v2]), tmp_path, budget)
    launched = {f"{e.replica.tier}/{e.replica.index}": (e.cores.cores, e.cores.shared_with)  # type: ignore[union-attr]
                for e in fleet._engines}
    assert launched == expected
    on_core: dict[int, set[str]] = {}
    for label, (cores_, _) in launched.items():
        for core in cores_:
            on_core.setdefault(core, set()).add(label)
    assert sorted(on_core) == budget  # every core is some engine's, and no engine runs outside the budget
    for label, (cores_, shared_with) in launched.items():  # a core is one engine's, or a group that says so
        assert all(on_core[core] == {label, *shared_with} for core in cores_)
    for e in fleet._engines:  # threads match the share, so co-located engines never spin on each other's cores
        assert e.env()["OMP_NUM_THREADS"] == str(len(e.cores.cores))  # type: ignore[union-attr]
    assert fleet.hardware_groups == {"full": "cpu:full", "mid": "cpu:mid"}  # mid's versions never crowd `full`
    status = fleet.status()["mid"]["versions"]["v2"]
    assert status["replicas"][0]["cores"] == list(expected["mid@v2/0"][0])  # type: ignore[index]
    assert (status["quantize"], status["dtype"]) == (None, "fp32")


def test_a_workers_fleet_follows_every_versions_engines(tmp_path: Path) -> None:
    cat = local(full=True)
    parent = local_fleet(cat, tmp_path, [0, 1, 2, 3])
    path = tmp_path / "engines.json"
    write_document(path, parent.published())
    published = read_published(path)
    assert published is not None and set(published.replicas) == {("full", 0), ("mid", 0), ("mid@v2", 0)}
    worker = Fleet(cat, TierClient(), models_dir=tmp_path, log_dir=tmp_path, engines_file=path)
    assert worker._engines == [] and worker.core_shares == parent.core_shares
    assert worker._follower is not None and {r.tier for r in worker._follower.replicas} == {"full", "mid", "mid@v2"}


async def test_each_versions_engine_is_started_probed_and_restarted_on_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"  # a built model for is_prepared; the stub engine loads nothing
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(EngineProcess, "command", lambda self, port: [sys.executable, str(STUB_ENGINE), str(port)])
    monkeypatch.setattr("tiers.supervisor.BACKOFF_START_S", 0.1)
    fleet = local_fleet(local(model=str(model)), tmp_path)
    mid = fleet.catalogue.tiers["mid"]
    v1, v2 = fleet.replicas_of(mid)[0], fleet.replicas_of(mid.variant("v2"))[0]
    await fleet.start()
    try:
        await _wait(lambda: v1.healthy and v2.healthy)
        engines = {e.replica.tier: e for e in fleet._engines}
        v1_pid = engines["mid"].proc.pid  # type: ignore[union-attr]
        assert fleet.status()["mid"]["versions"]["v2"]["ready"] and v1.url != v2.url
        os.kill(engines["mid@v2"].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await _wait(lambda: not v2.healthy)
        assert not fleet.status()["mid"]["versions"]["v2"]["ready"]
        assert fleet.status()["mid"]["versions"]["v1"]["ready"] and "mid" not in fleet.unavailable()
        await _wait(lambda: v2.healthy)  # restarted, as any replica
        assert (v2.restarts, v1.restarts) == (1, 0) and engines["mid"].proc.pid == v1_pid  # type: ignore[union-attr]
    finally:
        await fleet.stop()
        await fleet.client.aclose()


async def _wait(cond: Any, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
