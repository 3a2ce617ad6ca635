"""The ladder under `tiergate serve --workers 2`: a reload answered by one worker is the ladder of both. It was the
answering worker's alone: the other refused a level of the new ladder (`level_not_found`) and went on applying the
old one (tests/gateway/ladder/test_reload_shared.py has the cases, on the controllers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tests.gateway.ladder.test_controller import LADDER
from tests.gateway.ladder.test_reload_shared import FIVE
from tests.gateway.test_workers import TRIES, _request, serve_workers, worker_of
from tests.stubs import ServerThread, StubState, stub_app


@pytest.fixture
def stub_url() -> Iterator[str]:
    server = ServerThread(stub_app(StubState())).start()
    yield server.url
    server.stop()


def test_a_reload_through_one_worker_is_the_ladder_of_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          redis_server: RedisServer, stub_url: str,
                                                          prepared_models: Path) -> None:
    ladder = tmp_path / "ladder.yaml"
    ladder.write_text(LADDER)
    monkeypatch.setenv("TIERGATE_LADDER_FILE", str(ladder))  # the workers' environment is this one's and more
    redis_server.flush()
    (tmp_path / "served").mkdir()
    with serve_workers(tmp_path / "served", redis_server.url, stub_url, prepared_models) as served:
        admin = served.keys["admin"]
        ladder.write_text(FIVE)
        reloaded = _request("POST", f"{served.url}/admin/degrade/reload", admin)
        assert reloaded.status_code == 200 and len(reloaded.json()["levels"]) == 5, reloaded.text
        for _ in range(TRIES):  # new connections until the other worker answers (each lands on either)
            other = _request("POST", f"{served.url}/admin/degrade/", admin, json={"level": 4, "reason": "drill"})
            if worker_of(other) != worker_of(reloaded):
                break
        assert worker_of(other) != worker_of(reloaded)
        assert other.status_code == 200 and other.json()["name"] == "extra", other.text
        assert other.json()["ladder"]["in_sync"] is True
