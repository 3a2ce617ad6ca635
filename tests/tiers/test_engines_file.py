"""Engines supervised by the parent of `tiergate serve --workers N`, followed by its workers through a file: a
worker routes to an engine only once its own probe has seen the start its parent published, follows restarts,
mirrors what is not ready, and plans the same core shares without starting an engine of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stubs import free_port
from tests.tiers.test_core_budget import catalogue
from tests.tiers.test_supervisor import STUB_ENGINE, StubEngineProcess, built_model, spec, wait_until
from tiers import supervisor
from tiers.client import TierClient
from tiers.engines_file import EngineFollower, engines_document, publish_engines, read_published, write_document
from tiers.fleet import Fleet
from tiers.replica import Replica


@pytest.fixture
def stub_engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A stub engine whose start nonce is `nonce-b`, and the file that makes it sick."""
    port, mode = free_port(), tmp_path / "mode"
    proc = subprocess.Popen([sys.executable, str(STUB_ENGINE), str(port), str(mode)],
                            env=os.environ | {"TIERGATE_ENGINE_INSTANCE": "nonce-b"})
    yield f"http://127.0.0.1:{port}", mode
    proc.kill()
    proc.wait()


def publish(path: Path, url: str, instance: str, status: str = "ready", reason: str = "") -> None:
    write_document(path, {"core_budget": None, "replicas": [
        {"tier": "mid", "index": 0, "url": url, "instance": instance, "status": status, "reason": reason,
         "restarts": 0}]})


async def test_a_worker_follows_its_parents_engine_through_a_restart(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_START_S", 1.0)  # a restart after the worker has seen it down
    client = TierClient()
    parent = Replica("mid", 0)
    engine = StubEngineProcess(spec(str(built_model(tmp_path))), parent, models_dir=tmp_path,
                               log_dir=tmp_path / "logs", client=client, start_timeout_s=30, health_every_s=0.1)
    path = tmp_path / "engines.json"
    publisher = asyncio.create_task(publish_engines(path, lambda: engines_document([0, 1], [engine]), every_s=0.02))
    worker = Replica("mid", 0)
    follower = EngineFollower(path, [worker], client, probe_timeout_s=0.5)
    running = asyncio.create_task(engine.run())
    try:
        await wait_until(lambda: parent.healthy)
        await asyncio.sleep(0.1)  # published
        await follower.step()
        assert worker.healthy and worker.url == parent.url and worker.reason == ""
        assert read_published(path).core_budget == [0, 1]  # type: ignore[union-attr]
        first_url = parent.url
        os.kill(engine.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await wait_until(lambda: parent.status == "down")
        await asyncio.sleep(0.1)
        await follower.step()
        assert not worker.healthy and worker.status == "down" and "restarting" in worker.reason
        await wait_until(lambda: parent.healthy)
        await asyncio.sleep(0.1)
        await follower.step()
        assert worker.healthy and worker.url == parent.url != first_url
    finally:
        publisher.cancel()
        await engine.stop()
        running.cancel()
        await client.aclose()


async def test_a_stranger_on_the_published_port_is_never_routed_to(tmp_path: Path,
                                                                   stub_engine: tuple[str, Path]) -> None:
    url, _ = stub_engine
    path = tmp_path / "engines.json"
    publish(path, url, "nonce-a")  # the parent's engine was nonce-a; something else answers there now
    client = TierClient()
    worker = Replica("mid", 0)
    follower = EngineFollower(path, [worker], client, probe_timeout_s=0.5)
    try:
        await wait_until(lambda: _answers(url))
        for _ in range(4):  # however often it probes
            await follower.step()
            assert not worker.healthy and worker.status == "starting" and "another instance" in worker.reason
    finally:
        await client.aclose()


async def test_what_the_parent_reports_not_ready_is_mirrored_and_failed_probes_mark_it_down(
        tmp_path: Path, stub_engine: tuple[str, Path]) -> None:
    url, mode = stub_engine
    path = tmp_path / "engines.json"
    client = TierClient()
    worker = Replica("mid", 0)
    follower = EngineFollower(path, [worker], client, probe_timeout_s=0.5)
    try:
        await follower.step()  # no file: nothing to route to
        assert worker.status == "down" and str(path) in worker.reason
        publish(path, None, "", "preparing", "model 'students/small' is being distilled: 40%")  # type: ignore[arg-type]
        await follower.step()
        assert (worker.status, worker.reason) == ("preparing", "model 'students/small' is being distilled: 40%")
        publish(path, url, "nonce-b")
        await wait_until(lambda: _answers(url))
        await follower.step()
        assert worker.healthy
        mode.write_text("dead")  # its loop died: /health answers 503
        marks = []
        for _ in range(3):
            await follower.step()
            marks.append((worker.status, worker.healthy))
        assert marks == [("ready", True), ("ready", True), ("down", False)]  # one slow probe is not an outage
        assert "3 health probes from this worker failed" in worker.reason
    finally:
        await client.aclose()


def test_a_workers_fleet_starts_no_engine_and_plans_the_parents_core_shares(tmp_path: Path) -> None:
    cat = catalogue("small", "mid", "full")
    client = TierClient()
    parent = Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, core_budget=[2, 3, 4, 5])
    path = tmp_path / "engines.json"
    with pytest.raises(RuntimeError, match="no local engines published"):
        Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, engines_file=path)
    write_document(path, parent.published())
    worker = Fleet(cat, client, models_dir=tmp_path, log_dir=tmp_path, engines_file=path)
    assert len(parent._engines) == 3 and worker._engines == []
    assert worker.core_shares == parent.core_shares and worker.hardware_groups == parent.hardware_groups
    assert worker.status()["full"]["replicas"][0]["cores"] == [2, 3]
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it holds the engines' nonces


def test_a_document_that_cannot_be_written_leaves_the_last_one_and_no_temporary_file(tmp_path: Path) -> None:
    """The parent rewrites the file for as long as it runs; a write that fails part-way left its temporary file (with
    part of the nonces) in the data directory."""
    path = tmp_path / "engines.json"
    publish(path, "http://127.0.0.1:1", "n1")
    with pytest.raises(TypeError):
        write_document(path, {"core_budget": None, "replicas": [{"tier": "mid", "instance": object()}]})
    published = read_published(path)
    assert published is not None and published.replicas[("mid", 0)].instance == "n1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines.json"]


def _answers(url: str) -> bool:
    import httpx

    try:
        httpx.get(f"{url}/health", timeout=0.5)
    except httpx.HTTPError as exc:
        return isinstance(exc, httpx.HTTPStatusError)
    return True
