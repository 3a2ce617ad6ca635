"""TIERGATE_* settings that would start a gateway wrong are refused at start-up, one line naming the variable, before
anything is written: an empty host (every interface), an empty path (the current directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from pydantic import ValidationError

from gateway.cli.main import cli
from gateway.settings import Settings
from tests.stubs import free_port


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
