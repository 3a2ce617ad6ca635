"""bench/gateway_profile.py's reading of py-spy's raw stacks: a function's lines count together, self and inclusive."""

from __future__ import annotations

from pathlib import Path

from bench.gateway_profile import function_of, is_ours, shares


def test_shares_count_each_function_once_per_stack(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text("main (a.py:1);handle (b.py:10);count (c.py:5) 6\n"
                   "main (a.py:1);handle (b.py:12);handle (b.py:30) 3\n"  # recursion: inclusive counts it once
                   "Thread.run (threading.py:982) 1\n\n")
    total, own, under = shares(raw)
    assert total == 10
    assert own == {"count (c.py)": 6, "handle (b.py)": 3, "Thread.run (threading.py)": 1}
    assert under["handle (b.py)"] == 9 and under["main (a.py)"] == 9 and under["count (c.py)"] == 6


def test_function_of() -> None:
    assert function_of("Runner.run (asyncio/runners.py:118)") == "Runner.run (asyncio/runners.py)"
    assert function_of("<native>") == "<native>"


def test_is_ours() -> None:
    assert is_ours("Pipeline.handle (gateway/pipeline/handle.py)")
    assert is_ours("TierClient._stream (tiers/client.py)")
    assert not is_ours("serve (gateway/cli/serve.py)")
    assert not is_ours("Runner.run (asyncio/runners.py)")
    assert not is_ours("<native>")
