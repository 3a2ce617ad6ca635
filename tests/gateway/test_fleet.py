"""A fleet, as README's "Deployment" runs it: 3 gateway replicas, each with a data directory of its own (as
separate hosts have), one PostgreSQL (tenants, keys, data versions, ledger, audit, idempotency records), one
Redis (quotas, the cache, the ladder's level), one stub upstream.

What must hold across hosts: a key revoked or rotated on one replica is refused by the others within a
second; a new tenant and a plan change reach them too; a data-version bump on one makes the old cached answer
a miss on the others; the ladder level set on one is in force on the others within a second; a quota race
over all three is exact; one usage report (any replica's, or the CLI's) covers all three; a replica killed
with SIGKILL under load loses no ledger row of an answer its client received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from gateway.stores import open_ledger, open_tenant_store
from gateway.tenants.records import ADMIN
from tests.conftest import RedisServer, stop_processes
from tests.postgres import PostgresServer
from tests.stubs import free_port

ROOT = Path(__file__).resolve().parents[2]
PLANS = """
default_plan: standard
plans:
  standard: {allowed_tiers: [mid, full], default_tier: mid}
  fullonly: {allowed_tiers: [full], default_tier: full}
  rpm: {allowed_tiers: [mid], default_tier: mid, limits: {rpm: 100}}
"""
TIERS = """
tiers:
  mid: {backend: openai, model: stub-mid, urls: ["{url}"], price_per_1k_input: "0.001", price_per_1k_output: "0.002",
        hardware_cost_per_hour: "1", context_limit: 4096}
  full: {backend: openai, model: stub-full, urls: ["{url}"], price_per_1k_input: "0.003",
         price_per_1k_output: "0.006", hardware_cost_per_hour: "2", context_limit: 4096}
"""


@dataclass
class Fleet:
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    settings: Settings  # what the CLI and the tests use: the fleet's database and Redis, a data dir of their own
    env: dict[str, str]
    admin: str
    keys: dict[str, str]  # tenant -> a key

    def client(self, i: int, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.urls[i], headers={"authorization": f"Bearer {key}"}, timeout=30)

    def rows(self, tenant: str) -> list[Any]:
        ledger = open_ledger(self.settings)
        try:
            return ledger.rows(tenant=tenant)
        finally:
            ledger.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, postgres_server: PostgresServer,
          prepared_models: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    database_url = postgres_server.create_database()
    redis = RedisServer().start()
    stub_port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.stubs", str(stub_port)], cwd=ROOT)]
    (tmp / "tiers.yaml").write_text(TIERS.replace("{url}", f"http://127.0.0.1:{stub_port}"))
    (tmp / "plans.yaml").write_text(PLANS)
    env = os.environ | {"TIERGATE_DATABASE_URL": database_url, "TIERGATE_REDIS_URL": redis.url,
                        "TIERGATE_MODELS_DIR": str(prepared_models), "TIERGATE_TIERS_FILE": str(tmp / "tiers.yaml"),
                        "TIERGATE_PLANS_FILE": str(tmp / "plans.yaml"), "TIERGATE_BUILD_MISSING_MODELS": "0",
                        "TIERGATE_REDIS_FAILURE_MODE": "closed", "TIERGATE_DATA_DIR": str(tmp / "operator")}
    settings = Settings(data_dir=tmp / "operator", models_dir=prepared_models, tiers_file=tmp / "tiers.yaml",
                        plans_file=tmp / "plans.yaml", redis_url=redis.url, database_url=database_url)
    store = open_tenant_store(settings)
    _, admin = store.issue_key(None, roles=(ADMIN,))
    keys = {}
    for tenant, plan in (("acme", "standard"), ("racer", "rpm"), ("usage", "standard"), ("load", "standard")):
        store.create_tenant(tenant, plan)
        keys[tenant] = store.issue_key(tenant)[1]
    store.close()
    urls, logs = [], []
    for host in range(3):  # each its own data directory, as on its own host
        port = free_port()
        logs.append(tmp / f"replica-{host}.log")
        out = open(logs[-1], "w")  # noqa: SIM115 (kept open for the process's life)
        procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve"], cwd=ROOT,
                                      env=env | {"TIERGATE_DATA_DIR": str(tmp / f"host-{host}"),
                                                 "TIERGATE_PORT": str(port)},
                                      stdout=out, stderr=out, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url, log in zip(urls, logs, strict=True):
            _wait_ready(url, log)
        yield Fleet(urls, procs, settings, env, admin, keys)
    finally:
        stop_processes(procs)
        redis.stop()
        postgres_server.drop_database(database_url)


def _wait_ready(url: str, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"replica {url} did not start: {log.read_text()[-3000:]}")


def within(check: Callable[[], bool], seconds: float = 1.0) -> float:
    """Seconds until `check()` held; fails the test if that took more than `seconds`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < seconds, f"not within {seconds} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def chat(c: httpx.Client, content: str = "hello there", **extra: Any) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": content}],
                                                **extra})


def test_a_revoked_or_rotated_key_is_refused_by_every_replica_within_a_second(fleet: Fleet) -> None:
    with fleet.client(0, fleet.admin) as admin:
        issued = admin.post("/admin/keys", json={"tenant": "acme"}).json()
        rotated = admin.post("/admin/keys", json={"tenant": "acme"}).json()
    key, old = issued["key"], rotated["key"]
    with contextlib.ExitStack() as open_clients:
        others = [open_clients.enter_context(fleet.client(i, k)) for k in (key, old) for i in (1, 2)]
        assert [chat(c).status_code for c in others] == [200] * 4  # known, and now cached, on replicas 2 and 3
        with fleet.client(0, fleet.admin) as admin:
            assert admin.post(f"/admin/keys/{issued['key_id']}/revoke").status_code == 200
            t0 = time.monotonic()
            new = admin.post(f"/admin/keys/{rotated['key_id']}/rotate", json={}).json()["key"]
        for c in others:
            within(lambda c=c: chat(c).status_code == 401, 1.0 - (time.monotonic() - t0))
    for i in (1, 2):
        with fleet.client(i, new) as c:
            assert chat(c).status_code == 200  # the replacement works everywhere at once


def test_a_new_tenant_and_a_plan_change_reach_every_replica(fleet: Fleet) -> None:
    with fleet.client(0, fleet.admin) as admin:
        assert admin.post("/admin/tenants", json={"name": "newco", "plan": "standard"}).status_code == 201
        key = admin.post("/admin/keys", json={"tenant": "newco"}).json()["key"]
    with contextlib.ExitStack() as open_clients:
        clients = [open_clients.enter_context(fleet.client(i, key)) for i in (1, 2)]
        assert [chat(c).status_code for c in clients] == [200, 200]
        cli = subprocess.run([sys.executable, "-m", "gateway.cli.main", "tenants", "set-plan", "newco", "fullonly"],
                             cwd=ROOT, env=fleet.env, capture_output=True, text=True, check=True)
        assert "newco is on plan fullonly" in cli.stdout
        for c in clients:  # the CLI committed before it exited: every replica refuses `mid` for the new plan
            within(lambda c=c: chat(c).status_code == 404)
            assert chat(c).json()["error"]["code"] == "model_not_found"


def test_a_data_version_bump_on_one_replica_makes_the_old_answer_a_miss_on_the_others(fleet: Fleet) -> None:
    with contextlib.ExitStack() as open_clients:
        clients = [open_clients.enter_context(fleet.client(i, fleet.keys["acme"])) for i in range(3)]
        # one question per replica that checks, so that one replica's fresh answer is not another's first lookup
        questions = {i: {"content": f"What is the boiling point of water at {i} km?", "temperature": 0}
                     for i in (0, 2)}
        for i, question in questions.items():
            assert chat(clients[1], **question).headers["x-tiergate-cache"] == "miss"  # answered and cached via 2
            within(lambda i=i, q=question: chat(clients[i], **q).headers["x-tiergate-cache"] == "hit", 5.0)  # shared
        with fleet.client(1, fleet.admin) as admin:
            assert admin.post("/admin/tenants/acme/data-version").json()["data_version"] == 1
            t0 = time.monotonic()
        for i, question in questions.items():
            within(lambda i=i, q=question: chat(clients[i], **q).headers["x-tiergate-cache"] == "miss",
                   1.0 - (time.monotonic() - t0))


def test_the_ladder_level_set_on_one_replica_is_in_force_on_the_others_within_a_second(fleet: Fleet) -> None:
    with contextlib.ExitStack() as open_clients:
        admins = [open_clients.enter_context(fleet.client(i, fleet.admin)) for i in range(3)]
        try:
            assert admins[0].post("/admin/degrade", json={"level": 1, "reason": "fleet drill"}).status_code == 200
            t0 = time.monotonic()
            for a in admins[1:]:
                within(lambda a=a: a.get("/admin/degrade").json()["level"] == 1, 1.0 - (time.monotonic() - t0))
            history = admins[2].get("/admin/degrade/history").json()  # the audit, from the fleet database
            assert "fleet drill" in json.dumps(history)
        finally:
            admins[0].post("/admin/degrade/auto")
            for a in admins[1:]:
                within(lambda a=a: a.get("/admin/degrade").json()["level"] == 0, 2.0)


def test_a_quota_race_over_every_replica_admits_exactly_the_limit(fleet: Fleet) -> None:
    async def race() -> list[int]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits,
                                     headers={"authorization": f"Bearer {fleet.keys['racer']}"}) as c:
            async def one(i: int) -> int:
                for _ in range(20):
                    r = await c.post(f"{fleet.urls[i % 3]}/v1/chat/completions",
                                     json={"model": "mid", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 5})
                    if r.status_code != 503:  # a retryable quota-service timeout under this burst, as SDKs retry
                        return r.status_code
                    await asyncio.sleep(0.2)
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(300)))

    codes = asyncio.run(race())
    assert codes.count(200) == 100 and codes.count(429) == 200, {c: codes.count(c) for c in set(codes)}
    assert len(fleet.rows("racer")) == 100  # every replica's rows, in one place


def test_one_usage_report_covers_every_replica(fleet: Fleet) -> None:
    for i in range(3):
        with fleet.client(i, fleet.keys["usage"]) as c:
            assert [chat(c, max_tokens=3).status_code for _ in range(i + 1)] == [200] * (i + 1)
    with fleet.client(1, fleet.admin) as admin:
        report = admin.get("/admin/usage/report", params={"by": "tenant", "tenant": "usage"}).json()["data"]
        assert admin.get("/admin/ops").json()["requests"] >= 6  # the dashboard's numbers are the fleet's too
    assert [(r["tenant"], r["requests"]) for r in report] == [("usage", 6)]
    cli = subprocess.run([sys.executable, "-m", "gateway.cli.main", "usage", "report", "--by", "tenant", "--tenant",
                          "usage", "--format", "json"], cwd=ROOT, env=fleet.env, capture_output=True, text=True,
                         check=True)
    assert [(r["tenant"], r["requests"]) for r in json.loads(cli.stdout)] == [("usage", 6)]


def test_a_replica_killed_under_load_loses_no_row_of_an_answer_received(fleet: Fleet) -> None:
    received: list[str] = []
    victim = fleet.procs[3]  # the third replica (procs[0] is the stub)

    async def load() -> None:
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {fleet.keys['load']}"}) as c:
            async def worker(i: int) -> None:
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    try:
                        r = await c.post(f"{fleet.urls[i % 3]}/v1/chat/completions",
                                         json={"model": "mid", "max_tokens": 5,
                                               "messages": [{"role": "user", "content": f"load {i}"}]})
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)  # the killed replica: connection refused or reset
                        continue
                    if r.status_code == 200:
                        received.append(r.json()["id"].removeprefix("chatcmpl-"))

            async def kill() -> None:
                await asyncio.sleep(1.0)
                os.killpg(victim.pid, signal.SIGKILL)

            await asyncio.gather(kill(), *(worker(i) for i in range(12)))

    asyncio.run(load())
    victim.wait(timeout=10)
    stored = {r.request_id for r in fleet.rows("load")}
    assert len(received) > 30 and set(received) <= stored
