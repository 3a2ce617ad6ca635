"""bench/redis_client.py runs end to end on a real redis-server: both parsers time the quota round trip, and
Redis' own time per script call is read back. Nothing here asserts a speed."""

from __future__ import annotations

import shutil

import pytest

from bench import redis_client


def test_the_redis_client_bench_times_both_parsers_through_the_quota_backend(capsys: pytest.CaptureFixture[str]
                                                                              ) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    redis_client.main(["--rounds", "2", "--calls", "20", "--server"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| python (RESP3) |", "| hiredis |"))]
    assert len(rows) == 2
    for row in rows:
        rounds = row.split(" | ")[2].rstrip(" |").split(", ")
        assert len(rounds) == 2 and all(float(r) > 0 for r in rounds)
    assert "fewer client CPU µs per pair" in out
    assert "Redis' own time per script call" in out and "over " in out

