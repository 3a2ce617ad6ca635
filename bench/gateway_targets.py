"""What bench/gateway.py measures, each started as its users run it: the mock upstream, Tiergate, LiteLLM's proxy.

Every server is a child process in its own session, pinned with `taskset`, logging to a file under the run's
work directory; `Server.stop` ends that process group only. Tiergate runs `python -m gateway.cli.main serve`
with the embedded default stores (SQLite ledger, memory quotas) and a tiers file that points every tier at the
mock; its tenant and key are created through the admin API. LiteLLM lives in its own virtualenv under /tmp,
never in the project's: a missing or broken install is reported as the reason it was skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
# the harness owns these (a fresh state and the mock's tiers each run); every other TIERGATE_* is honoured
OWNED_SETTINGS = ("TIERGATE_HOST", "TIERGATE_PORT", "TIERGATE_DATA_DIR", "TIERGATE_TIERS_FILE", "TIERGATE_PLANS_FILE")
TIER = """  {name}:
    backend: openai
    model: mock
    urls: ["{url}"]
    max_concurrency: 256
    price_per_1k_input: "{pin}"
    price_per_1k_output: "{pout}"
    hardware_cost_per_hour: "{hw}"
    context_limit: 8192
"""
PRICES = {"small": ("0.00005", "0.0001", "0.02"), "mid": ("0.0001", "0.0002", "0.04"),
          "full": ("0.0003", "0.0006", "0.08")}
# quotas on (every limit checked and reserved per request), set far above what a benchmark can spend
PLANS = """default_plan: bench
plans:
  bench:
    priority: standard
    allowed_tiers: [small, mid, full]
    default_tier: mid
    allow_upgrade: true
    max_queue_wait_s: 10
    shed_to_cheaper: true
    limits: {rpm: 100000000, tpm: 100000000000, max_concurrent: 100000, budget_day_usd: "9000000",
             budget_month_usd: "9000000"}  # the most a budget may be (quotas/plans.py)
"""


class TargetUnavailable(RuntimeError):
    """A target could not be started; the message says why (it is printed, and the run goes on without it)."""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    log: Path
    key: str | None = None  # what clients send as their bearer key
    health_path: str = "/health"  # answers 200 once the server can take work

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cpu_s(self) -> float:
        """CPU time (user + system) its processes have used so far, workers and other children included: per
        answer, the cost a noisy machine does not blur as it blurs rates (another process's load slows the
        target's clock, not what each answer takes)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                total += t.user + t.system
        return total

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cpus: list[int], argv: list[str]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv]


def spawn(name: str, argv: list[str], log: Path, *, cwd: Path, env: dict[str, str] | None = None,
          port: int) -> Server:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, proc, "127.0.0.1", port, log)


def wait_ready(server: Server, path: str, timeout_s: float) -> None:
    """Poll GET `path` until it answers 200; the server's log tail is in the error if it dies or never does."""
    server.health_path = path
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise TargetUnavailable(f"{server.name} exited ({server.proc.returncode}):\n{server.log_tail()}")
        try:
            r = httpx.get(server.url + path, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    server.stop()
    raise TargetUnavailable(f"{server.name} not ready after {timeout_s:.0f} s (last: {last}):\n{server.log_tail()}")


def settle(server: Server, quick_s: float = 0.05, timeout_s: float = 30.0) -> None:
    """Wait until the server is idle again (two health answers in a row within `quick_s`): requests a load
    generator abandoned at the end of a cell must not be served during the next one."""
    deadline = time.monotonic() + timeout_s
    fast = 0
    with httpx.Client(base_url=server.url, timeout=timeout_s) as client:
        while fast < 2 and time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                client.get(server.health_path)
            except httpx.HTTPError:
                fast = 0
                time.sleep(0.1)
                continue
            fast = fast + 1 if time.perf_counter() - t0 < quick_s else 0
            time.sleep(0.05)


def start_mock(workdir: Path, tokens: int) -> Server:
    """The mock upstream on the caller's CPUs (the harness pins itself to the load generator's core)."""
    port = free_port()
    server = spawn("mock", [sys.executable, "-m", "bench.gateway_mock", "--port", str(port), "--tokens", str(tokens)],
                   workdir / "mock.log", cwd=REPO, port=port)
    wait_ready(server, "/health", 30)
    return server


def serve_supports_workers(repo: Path) -> bool:
    out = subprocess.run([sys.executable, "-m", "gateway.cli.main", "serve", "--help"], cwd=repo, capture_output=True,
                         text=True, env=os.environ | {"PYTHONPATH": str(repo)}, timeout=120)
    return "--workers" in out.stdout


def tiergate_env(repo: Path, data_dir: Path, tiers: Path, plans: Path, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TIERGATE_BUILD_MISSING_MODELS", "0")
    env.setdefault("TIERGATE_MODELS_DIR", str(Path.home() / ".local" / "share" / "tiergate" / "models"))
    env |= {"TIERGATE_HOST": "127.0.0.1", "TIERGATE_PORT": str(port), "TIERGATE_DATA_DIR": str(data_dir),
            "TIERGATE_TIERS_FILE": str(tiers), "TIERGATE_PLANS_FILE": str(plans), "PYTHONPATH": str(repo)}
    return env


def start_redis(workdir: Path) -> Server:
    """A redis-server of the run's own (no persistence) on the caller's CPUs: the quota backend, cache and ladder
    that several gateway workers share (`tiergate serve --workers N` needs one)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("--workers needs redis-server (Debian: `apt-get install -y redis-server`): several gateway "
                         "workers count quotas there")
    port = free_port()
    server = spawn("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                   workdir / "redis.log", cwd=REPO, port=port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return server
        time.sleep(0.05)
    server.stop()
    raise SystemExit(f"redis-server did not answer on port {port}:\n{server.log_tail()}")


def write_bench_config(workdir: Path, mock_url: str) -> tuple[Path, Path]:
    """The benchmark's tiers (every one at the mock) and plans, written in `workdir`: their two paths."""
    workdir.mkdir(parents=True, exist_ok=True)
    tiers, plans = workdir / "tiers.yaml", workdir / "plans.yaml"
    tiers.write_text("tiers:\n" + "".join(TIER.format(name=t, url=mock_url, pin=p[0], pout=p[1], hw=p[2])
                                           for t, p in PRICES.items()))
    plans.write_text(PLANS)
    return tiers, plans


def start_tiergate(name: str, repo: Path, workdir: Path, mock_url: str, cpus: list[int], workers: int,
                   redis_url: str | None = None) -> Server:
    """`tiergate serve` from `repo` on `cpus`, every tier pointed at the mock; a tenant `bench` and its key.
    `redis_url`: quotas, cache and ladder there (what `--workers` above 1 needs), else the embedded stores."""
    tiers, plans = write_bench_config(workdir, mock_url)
    data_dir = workdir / "data"
    port = free_port()
    env = tiergate_env(repo, data_dir, tiers, plans, port)
    if redis_url:
        env["TIERGATE_REDIS_URL"] = redis_url
    imported = subprocess.run([sys.executable, "-c", "import gateway; print(gateway.__file__)"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=60).stdout.strip()
    if not imported.startswith(str(repo)):
        raise TargetUnavailable(f"{name}: `import gateway` from {repo} loads {imported!r}, not that tree")
    argv = [sys.executable, "-m", "gateway.cli.main", "serve"] + (["--workers", str(workers)] if workers > 1 else [])
    server = spawn(name, pinned(cpus, argv), workdir / "serve.log", cwd=repo, env=env, port=port)
    wait_ready(server, "/health", 300)
    try:
        server.key = _bench_key(server, data_dir)
    except (httpx.HTTPError, KeyError, OSError, ValueError) as exc:
        server.stop()
        raise TargetUnavailable(f"{name}: could not create the bench tenant and key: {exc!r}") from exc
    return server


def _bench_key(server: Server, data_dir: Path) -> str:
    admin = json.loads((data_dir / "bootstrap-keys.json").read_text())["admin_key"]
    headers = {"authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        client.post("/admin/tenants", json={"name": "bench", "plan": "bench"}).raise_for_status()
        r = client.post("/admin/keys", json={"tenant": "bench", "name": "bench"})
        r.raise_for_status()
        return str(r.json()["key"])


def ensure_litellm(venv: Path) -> str:
    """LiteLLM's proxy in its own virtualenv (installed there when missing); returns its version."""
    exe = venv / "bin" / "litellm"
    if not exe.exists():
        print(f"installing litellm[proxy] into {venv} (once; not a dependency of the project)", file=sys.stderr)
        base = shutil.which("python3") or sys.executable
        for argv in ([base, "-m", "venv", str(venv)], [str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise TargetUnavailable(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout)[-1500:]}")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; "
                           "print(m.version('litellm'))"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise TargetUnavailable(f"litellm in {venv} does not import: {proc.stderr[-1500:]}")
    return proc.stdout.strip()


def start_litellm(venv: Path, workdir: Path, mock_url: str, cpus: list[int], workers: int, model: str) -> Server:
    """LiteLLM's proxy, no database, one model `model` -> openai/ provider at the mock, a master key."""
    version = ensure_litellm(venv)
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "litellm.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model_list": [{"model_name": model, "litellm_params": {
            "model": "openai/mock", "api_base": f"{mock_url}/v1", "api_key": "sk-mock"}}],
        "general_settings": {"master_key": "sk-bench"},
    }, indent=2))
    port = free_port()
    # no network here: LiteLLM reads its bundled price map instead of fetching one, and logs errors only
    env = dict(os.environ) | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    env.pop("PYTHONPATH", None)
    argv = [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", str(workers)]
    server = spawn(f"LiteLLM {version}", pinned(cpus, argv), workdir / "litellm.log", cwd=workdir, env=env, port=port)
    wait_ready(server, "/health/liveliness", 240)
    server.key = "sk-bench"
    return server


@contextlib.contextmanager
def ref_worktree(rev: str, parent: Path) -> Iterator[tuple[Path, str]]:
    """A detached git worktree of `rev` (removed afterwards) and its short commit id."""
    commit = subprocess.run(["git", "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--compare-ref: {rev!r} is not a commit of {REPO}: {commit.stderr.strip()}")
    path = parent / f"tg-ref-{commit.stdout.strip()}"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), rev], cwd=REPO, check=True)
    try:
        yield path, commit.stdout.strip()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False)


def head_label() -> str:
    """HEAD's short id, with `+changes` when the working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
