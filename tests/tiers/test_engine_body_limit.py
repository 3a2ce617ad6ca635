"""A local engine's body limit follows the gateway's (`max_body_bytes`), plus a margin for what the gateway adds when
it forwards a body; `engine serve --max-body-bytes` takes it to the engine's app (the 413 itself:
tests/engine/test_server_body_limit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet
from tiers.supervisor import FORWARD_MARGIN_BYTES

CATALOGUE = TierCatalogue(tiers={"small": {
    "backend": "local", "model": "smollm2-135m-instruct", "context_limit": 1024, "price_per_1k_input": "0.0001",
    "price_per_1k_output": "0.0001", "hardware_cost_per_hour": "0"}})


def limit_in(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--max-body-bytes") + 1] if "--max-body-bytes" in cmd else None


def test_the_supervisor_passes_the_gateways_body_limit(tmp_path: Path) -> None:
    (engine,) = Fleet(CATALOGUE, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=None,
                      max_body_bytes=8 << 20)._engines
    assert limit_in(engine.command(9000)) == str((8 << 20) + FORWARD_MARGIN_BYTES)
    (default,) = Fleet(CATALOGUE, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=None)._engines
    assert limit_in(default.command(9000)) is None  # the engine's own default: the gateway's default


def test_engine_serve_takes_the_limit_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import launch
    from gateway.cli.main import cli

    served: dict[str, Any] = {}
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: served.update(kwargs))
    result = CliRunner().invoke(cli, ["engine", "serve", "--model", "x", "--max-body-bytes", "12345"])
    assert result.exit_code == 0, result.output
    assert served["max_body_bytes"] == 12345
    result = CliRunner().invoke(cli, ["engine", "serve", "--model", "x", "--max-body-bytes", "0"])
    assert result.exit_code == 2
