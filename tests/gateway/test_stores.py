"""Opening the stores a deployment uses (gateway/stores.py): a fleet database that cannot be reached at start-up
stops `tiergate serve` with one line that says why, never a driver's traceback or a wait without end (here with
TIERGATE_DATABASE_START_WAIT_S=0, one try: the wait itself is tests/gateway/test_start_database_down.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import create_app
from gateway.cli.main import cli
from gateway.settings import Settings
from gateway.stores import DatabaseUnreachable
from tests.stubs import free_port


def test_serve_with_the_fleet_database_unreachable_stops_with_one_line(gateway_settings: Settings,
                                                                      prepared_models: Path) -> None:
    s = gateway_settings
    url = f"postgresql://tiergate:s3cret-pw@127.0.0.1:{free_port()}/fleet"  # nothing listens there
    r = CliRunner().invoke(cli, ["serve", "--tiers", str(s.tiers_file), "--plans", str(s.plans_file),
                                 "--models-dir", str(prepared_models), "--data-dir", str(s.data_dir)],
                           env={"TIERGATE_DATABASE_URL": url, "TIERGATE_DATABASE_START_WAIT_S": "0"})
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the fleet database (TIERGATE_DATABASE_URL) cannot be "
                                                   "reached: connection failed"), r.output
    assert "s3cret-pw" not in r.output


def test_create_app_with_the_fleet_database_unreachable_says_so(gateway_settings: Settings) -> None:
    settings = gateway_settings.model_copy(update={"database_url": f"postgresql://tiergate@127.0.0.1:{free_port()}/x",
                                                    "database_start_wait_s": 0.0})
    with pytest.raises(DatabaseUnreachable, match="cannot be reached"):
        create_app(settings)
