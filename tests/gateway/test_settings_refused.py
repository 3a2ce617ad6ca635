"""TIERGATE_* settings that would start a gateway wrong are refused at start-up, one line naming the variable, before
anything is written: an empty host (every interface), an empty path (the current directory)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from pydantic import ValidationError

from gateway.cli.main import cli
from gateway.settings import Settings
from tests.stubs import free_port
from tiers.core_plan import host_core_budget


def run(args: list[str], **env: str) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": "", **env})


def refused(r: Result, *words: str) -> str:
    """One line naming `words`, exit status 1, no traceback (CliRunner keeps an uncaught error as `exception`)."""
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), f"{r.exception!r} {r.output}"
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and all(w in lines[0] for w in words), r.output
    return lines[0]


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_host_is_refused_not_every_interface(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("TIERGATE_HOST", host)
    with pytest.raises(ValidationError, match="every interface"):
        Settings()


def test_serve_with_an_empty_host_says_so_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers: [\n")  # without the check, the run ends here (never serving)
    data = tmp_path / "data"
    refused(run(["serve", "--tiers", str(broken), "--port", str(free_port()), "--data-dir", str(data)],
                TIERGATE_HOST=""), "TIERGATE_HOST", "every interface")
    assert not data.exists()


def test_the_default_host_and_an_explicit_every_interface_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_HOST", raising=False)
    assert Settings().host == "127.0.0.1"
    monkeypatch.setenv("TIERGATE_HOST", "0.0.0.0")
    assert Settings().host == "0.0.0.0"


@pytest.mark.parametrize("name", ["TIERGATE_DATA_DIR", "TIERGATE_MODELS_DIR", "TIERGATE_TIERS_FILE",
                                  "TIERGATE_PLANS_FILE", "TIERGATE_LADDER_FILE", "TIERGATE_ENGINES_FILE"])
def test_an_empty_path_is_refused_not_the_current_directory(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "")
    with pytest.raises(ValidationError, match="current directory"):
        Settings()


def test_an_empty_data_dir_writes_no_state_db_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    refused(run(["tenants", "create", "acme"], TIERGATE_DATA_DIR=""), "TIERGATE_DATA_DIR", "current directory")
    assert list(tmp_path.iterdir()) == []


BAD_NUMBERS = [
    ("TIERGATE_LADDER_TICK_S", "-1"), ("TIERGATE_LADDER_TICK_S", "0"), ("TIERGATE_LADDER_TICK_S", "nan"),
    ("TIERGATE_LADDER_TICK_S", "inf"), ("TIERGATE_MAX_BODY_BYTES", "-1"), ("TIERGATE_DEFAULT_MAX_TOKENS", "0"),
    ("TIERGATE_DEFAULT_MAX_TOKENS", "-1"), ("TIERGATE_REMOTE_MAX_CONCURRENCY", "0"),
    ("TIERGATE_REMOTE_MAX_CONCURRENCY", "-2"), ("TIERGATE_REDIS_TIMEOUT_S", "nan"), ("TIERGATE_REDIS_TIMEOUT_S", "-1"),
    ("TIERGATE_REDIS_MAX_CONNECTIONS", "0"), ("TIERGATE_REDIS_POOL_WAIT_S", "0"), ("TIERGATE_CACHE_MAX_ENTRIES", "-1"),
    ("TIERGATE_CACHE_MAX_ENTRIES_PER_TENANT", "0"), ("TIERGATE_CACHE_EMBED_MAX_BATCH", "0"),
    ("TIERGATE_CACHE_EMBED_MAX_WAIT_MS", "nan"), ("TIERGATE_ENGINE_START_TIMEOUT_S", "0"),
    ("TIERGATE_UPSTREAM_READ_TIMEOUT_S", "nan"), ("TIERGATE_UPSTREAM_CONNECT_TIMEOUT_S", "-5"),
    ("TIERGATE_REQUEST_RECEIPT_TIMEOUT_S", "inf"), ("TIERGATE_RESPONSE_STALL_TIMEOUT_S", "nan"),
    ("TIERGATE_WORKERS", "1000000"), ("TIERGATE_DATABASE_MAX_CONNECTIONS", "0"),
    ("TIERGATE_QUOTA_SETTLE_RETRY_S", "-1"), ("TIERGATE_QUOTA_LEASE_S", "inf"), ("TIERGATE_QUOTA_REAP_EVERY_S", "nan"),
    ("TIERGATE_REDIS_EVICTION_CHECK_S", "inf"), ("TIERGATE_TENANT_LOOKUP_LOCK_TIMEOUT_S", "nan"),
    ("TIERGATE_LEDGER_READ_LOCK_TIMEOUT_S", "-1"), ("TIERGATE_CONNECTION_SHARE_PER_ADDRESS", "nan"),
]


@pytest.mark.parametrize(("name", "value"), BAD_NUMBERS)
def test_a_number_out_of_its_bounds_is_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert [e["loc"] for e in caught.value.errors()] == [(name.removeprefix("TIERGATE_").lower(),)]


@pytest.mark.parametrize(("name", "value"), [("TIERGATE_LADDER_TICK_S", "nan"), ("TIERGATE_WORKERS", "1000000")])
def test_serve_names_the_bad_number_in_one_line(tmp_path: Path, name: str, value: str) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers: [\n")  # without the check, the run ends here
    refused(run(["serve", "--tiers", str(broken), "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
                **{name: value}), f"({name})")
    assert not (tmp_path / "d").exists()


def test_every_default_is_within_its_bounds_and_the_bounds_take_sane_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n, _ in BAD_NUMBERS]:
        monkeypatch.delenv(name, raising=False)
    defaults = Settings()
    assert Settings.model_validate(defaults.model_dump()) == defaults
    taken = Settings(ladder_tick_s=0.01, workers=64, quota_settle_retry_s=0, cache_embed_max_wait_ms=0,
                     tenant_lookup_lock_timeout_s=0, cache_embed_max_batch=1, max_body_bytes=1)
    assert (taken.ladder_tick_s, taken.workers) == (0.01, 64)


def test_serve_workers_flag_is_capped_at_the_option(tmp_path: Path) -> None:
    r = run(["serve", "--workers", "65", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "'--workers'" in r.output and "64" in r.output, r.output


@pytest.mark.parametrize(("name", "value"), [
    ("TIERGATE_CACHE_EMBED_MAX_BATCH", "0"), ("TIERGATE_EMBEDDER_RUNTIME", "bogus"),
    ("TIERGATE_GATEWAY_CORES", "abc"), ("TIERGATE_GATEWAY_CORES", "-1"), ("TIERGATE_CORE_BUDGET", "bogus"),
])
def test_a_setting_read_outside_settings_is_refused_before_anything_is_written(tmp_path: Path, name: str,
                                                                               value: str) -> None:
    """They failed once start-up had written state.db, ledger.db and cache.sqlite3 (a 50-line traceback), or, for
    the core budget, were taken as on."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers: [\n")  # without the check, the run ends here
    refused(run(["serve", "--tiers", str(broken), "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
                **{name: value}), f"({name})")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(("env", "expected"), [
    ({}, ("auto", "on", None)),
    ({"TIERGATE_EMBEDDER_RUNTIME": "", "TIERGATE_CORE_BUDGET": "", "TIERGATE_GATEWAY_CORES": ""}, ("auto", "on", None)),
    ({"TIERGATE_EMBEDDER_RUNTIME": "onnx", "TIERGATE_CORE_BUDGET": " OFF ", "TIERGATE_GATEWAY_CORES": "2"},
     ("onnx", "off", 2)),
    ({"TIERGATE_CORE_BUDGET": "no"}, ("auto", "off", None)), ({"TIERGATE_CORE_BUDGET": "Yes"}, ("auto", "on", None)),
])
def test_what_those_settings_take(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                  expected: tuple[object, ...]) -> None:
    for name in ("TIERGATE_EMBEDDER_RUNTIME", "TIERGATE_CORE_BUDGET", "TIERGATE_GATEWAY_CORES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = Settings()
    assert (s.embedder_runtime, s.core_budget, s.gateway_cores) == expected


def test_the_core_plan_never_takes_an_unknown_core_budget_as_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_CORE_BUDGET", "bogus")
    with pytest.raises(ValueError, match="TIERGATE_CORE_BUDGET"):
        host_core_budget([0, 1, 2, 3])
    monkeypatch.setenv("TIERGATE_CORE_BUDGET", "false")
    assert host_core_budget([0, 1, 2, 3]) is None


def test_serve_says_which_model_failed_to_prepare_in_one_line(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The `models fetch` child prints its own error; serve added a traceback of CalledProcessError under it."""
    def failing_child(args: list[str], **_: object) -> None:
        raise subprocess.CalledProcessError(1, args)

    monkeypatch.setattr(subprocess, "run", failing_child)
    line = refused(run(["serve", "--port", str(free_port()), "--models-dir", str(tmp_path / "models"),
                        "--data-dir", str(tmp_path / "d")]), "preparing model", "failed (see above)")
    assert "smollm2-135m-instruct" in line or "all-MiniLM-L6-v2" in line, line
    assert not (tmp_path / "d").exists()
