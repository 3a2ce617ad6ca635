"""bench/gateway.py's own parts: the mock upstream answers in the shapes the gateway reads, and the harness reads
wrk's output and computes percentiles as wrk does. No wrk needed; nothing here is timed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from bench.gateway_load import Cell, parse_wrk, percentile, stream_probe
from bench.gateway_mock import start_mock
from tiers.client import TierClient
from tiers.errors import UpstreamRejected

# what the gateway sends its upstream (gateway/pipeline/tier_call.py): always a stream, usage in every chunk
GATEWAY_BODY = {"model": "mock", "messages": [{"role": "user", "content": "three words here"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

# wrk 4.1.0 running bench/gateway.lua against a gateway: its usual report, then done()'s line
WRK_OUTPUT = """Running 2s test @ http://127.0.0.1:40123/v1/chat/completions
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    35.91ms    6.01ms  57.07ms   71.20%
    Req/Sec   462.10     40.12   520.00     75.00%
  920 requests in 2.00s, 1.05MB read
  Non-2xx or 3xx responses: 3
Requests/sec:    459.77
Transfer/sec:    537.51KB
BENCH_RESULT {"requests":920,"duration_us":2001000,"bytes":1101000,"errors":{"connect":0,"read":1,"write":0,\
"status":3,"timeout":2},"answers":{"2xx":917,"other":3,"hit":900,"miss":17,"bypass":0,"none":3},\
"refusals":{"503 overloaded":2,"429 rate_limit_exceeded":1},\
"latency_us":{"min":9012,"mean":35910.4,"max":57070,"p50":35840,"p90":43100,"p99":57065,"p99.9":57070}}
"""


@pytest.fixture
async def mock_url() -> AsyncIterator[str]:
    server = await start_mock("127.0.0.1", 0, max_tokens=8)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


async def test_the_gateway_tier_client_reads_the_mock_stream_with_usage_and_busy_time_in_every_token(
        mock_url: str) -> None:
    client = TierClient()
    try:
        chunks = [c async for c in client.stream_chat(mock_url, GATEWAY_BODY)]
        models = await client.get_json(f"{mock_url}/v1/models")
        with pytest.raises(UpstreamRejected):  # a body that is not OpenAI's gets OpenAI's 400
            _ = [c async for c in client.stream_chat(mock_url, {"model": "mock"})]
    finally:
        await client.aclose()
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == " t0 t1 t2 t3 t4"  # max_tokens: 5 of 8
    assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3, 4, 5]
    assert all(c["usage"]["prompt_tokens"] == 3 and c["x_tiergate"]["busy_s"] > 0 for c in tokens)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
    assert chunks[-1]["x_tiergate"]["busy_s"] == pytest.approx(0.005)
    assert models["data"][0]["id"] == "mock"


async def test_the_mock_answers_whole_completions_health_and_unknown_routes(mock_url: str) -> None:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient(base_url=mock_url) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        health = await client.get("/health")
        missing = await client.get("/nope")
        bad = await client.post("/v1/chat/completions", content=b"{not json")
    assert whole["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4 t5 t6 t7"
    assert whole["choices"][0]["finish_reason"] == "stop"  # no max_tokens: the answer ends on its own
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}
    assert whole["x_tiergate"]["busy_s"] > 0
    assert health.json() == {"status": "ok"}
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert bad.status_code == 400


def test_wrk_output_is_read_into_rates_percentiles_and_errors() -> None:
    cell = parse_wrk(WRK_OUTPUT, Cell("Tiergate", "b", 16, 2.0))
    assert cell.requests == 920
    assert cell.rps == pytest.approx(920 / 2.001)
    assert (cell.p50_ms, cell.p99_ms) == (35.84, 57.065)
    assert cell.errors == 6 and cell.error_detail == {"read": 1, "status": 3, "timeout": 2}
    assert cell.answers["hit"] == 900 and cell.answers["other"] == 3
    assert cell.refusals == {"503 overloaded": 2, "429 rate_limit_exceeded": 1}  # what refused the 3, by code


def test_the_report_says_what_refused_the_answers_that_were_not_2xx() -> None:
    from bench.gateway_report import _answers, collapse
    cells = [parse_wrk(WRK_OUTPUT, Cell("Tiergate", "b", 16, 2.0, round=r)) for r in range(2)]
    assert _answers(cells[0]) == "917 ok, 3 not 2xx (429 rate_limit_exceeded: 1, 503 overloaded: 2), 900 hit, 17 miss"
    (merged,) = collapse(cells)  # rounds summed
    assert merged.refusals == {"503 overloaded": 4, "429 rate_limit_exceeded": 2}


def test_a_wrk_run_without_its_result_line_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="BENCH_RESULT"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n", Cell("x", "a", 1, 1.0))


def test_percentiles_follow_wrk_rule() -> None:
    # stats.c: the smallest value whose cumulative count reaches round(p/100 * n + 0.5)
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert [percentile(values, p) for p in (50, 90, 99, 99.9, 100)] == [51, 91, 100, 100, 100]
    assert percentile([7.0, 1.0, 3.0, 5.0], 50) == 5.0  # rank round(2.5) = 3
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)


@pytest.fixture
def mock_port() -> Iterator[int]:
    """The mock in a thread of its own, for the probe, which runs its own event loop."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(start_mock("127.0.0.1", 0, max_tokens=16))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield server.sockets[0].getsockname()[1]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    server.close()
    loop.run_until_complete(server.wait_closed())
    loop.close()


def test_the_stream_probe_times_first_text_and_counts_every_text_chunk(mock_port: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me @UNIQUE@"}], "max_tokens": 12,
            "stream": True}
    cell = stream_probe(Cell("mock alone", "d", 2, 0.3), "127.0.0.1", mock_port, "/v1/chat/completions", key=None,
                        body=body, nonce=1)
    assert cell.requests > 0 and cell.errors == 0
    assert cell.chunks_p50 == 12
    assert cell.ttft_p50_ms is not None and cell.p50_ms is not None and cell.ttft_p50_ms <= cell.p50_ms
    lost = stream_probe(Cell("nothing", "d", 1, 0.2), "127.0.0.1", mock_port, "/no-such-route", key=None,
                        body=body, nonce=2)
    assert lost.requests == 0 and lost.errors > 0  # a 404 is counted as an error, never as a stream


def test_the_report_compares_cpu_per_answer_with_the_reference_and_groups_rows_by_target() -> None:
    from bench.gateway import PATHS
    from bench.gateway_report import _plain_table

    def cell(target: str, c: int, rps: float, cpu: float) -> Cell:
        return Cell(target, "b", c, 2.0, requests=1000, rps=rps, p50_ms=1.0, p99_ms=2.0, answers={"2xx": 1000},
                    cpu_ms_per_request=cpu)

    ref = "Tiergate @ abc1234 (ref)"
    cells = [cell("Tiergate x", 1, 500, 1.5), cell(ref, 1, 400, 2.0), cell("Tiergate x", 16, 800, 1.0),
             cell(ref, 16, 1000, 0.8)]  # measured alternately
    rows = _plain_table(PATHS["b"], cells, ref)[2:]
    assert [r.split(" | ")[0:2] for r in rows] == [["| Tiergate x", "1"], ["| Tiergate x", "16"], [f"| {ref}", "1"],
                                                   [f"| {ref}", "16"]]
    assert rows[0].endswith("| 1.25x | 1.33x |") and rows[1].endswith("| 0.80x | 0.80x |")  # req/s, CPU per answer
    assert "| 1.50 |" in rows[0] and rows[2].endswith("| — | — | — |")


def test_the_scaling_line_gives_the_ratio_and_the_cores_the_load_took_from_the_workers() -> None:
    from bench.gateway import PATHS
    from bench.gateway_report import _scaling

    one = Cell("Tiergate x 1 worker", "a", 64, 2.0, rps=400.0, load_cores=0.05)
    many = Cell("Tiergate x 2 workers", "a", 64, 2.0, rps=700.0, load_cores=0.23)
    line = _scaling(PATHS["a"], [one, many], 2)
    assert "c=64 1.75x" in line
    assert "c=64 0.23" in line and "0.05" not in line  # the load during the 2-worker cell, not the 1-worker one
    assert _scaling(PATHS["a"], [one, many], 1) == ""


def test_rounds_give_every_rounds_ratio_and_tables_of_medians() -> None:
    from bench.gateway import PATHS
    from bench.gateway_report import _scaling, collapse

    def cell(target: str, r: int, rps: float, p99: float, load: float | None = None) -> Cell:
        return Cell(target, "a", 64, 2.0, requests=int(rps * 2), rps=rps, p50_ms=1.0, p99_ms=p99,
                    answers={"2xx": int(rps * 2)}, cpu_ms_per_request=1000 / rps, load_cores=load, round=r)

    cells = [cell("T 1 worker", 0, 400, 90), cell("T 2 workers", 0, 600, 80, 0.2),
             cell("T 1 worker", 1, 500, 300), cell("T 2 workers", 1, 1000, 70, 0.3),
             cell("T 1 worker", 2, 450, 100), cell("T 2 workers", 2, 810, 95, 0.25)]
    line = _scaling(PATHS["a"], cells, 2)
    assert "c=64 1.50x, 2.00x, 1.80x (median 1.80x)" in line  # each round's 2 workers over the same round's 1
    assert "c=64 0.20, 0.30, 0.25" in line
    merged = collapse(cells)
    assert [(m.target, m.rps, m.p99_ms, m.requests) for m in merged] == [("T 1 worker", 450, 100, 2700),
                                                                        ("T 2 workers", 810, 80, 4820)]
    assert merged[0].answers == {"2xx": 2700} and merged[1].load_cores == 0.25
    single = [cell("T 1 worker", 0, 400, 90)]
    assert collapse(single) == single  # one round: the cell as measured


@pytest.mark.parametrize(("cpus", "workers", "load", "gateway"), [
    (2, 1, [0], [1]),  # this project's machines: the load on one core, the gateway on the other
    (3, 2, [0], [1, 2]),
    (5, 2, [0, 1, 2], [3, 4]),
    (16, 2, [0, 1, 2, 3], [4, 5]),  # a larger host: the load gets up to 4 CPUs of its own, never a worker's
    (16, 4, [0, 1, 2, 3], [4, 5, 6, 7]),
])
def test_the_load_side_takes_spare_cpus_and_never_a_workers(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                              workers: int, load: list[int],
                                                              gateway: list[int]) -> None:
    import bench.gateway as harness
    monkeypatch.setattr(harness.os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    monkeypatch.setattr(harness, "ensure_wrk", lambda: None)
    monkeypatch.setattr(harness, "serve_supports_workers", lambda _repo: True)
    monkeypatch.setattr(harness.shutil, "which", lambda _name: "/usr/bin/taskset")
    monkeypatch.setattr(harness, "physical_cores", lambda usable: [[cpu] for cpu in usable])  # no SMT
    assert harness.check_host(harness.parse_args(["--workers", str(workers)])) == (load, gateway)


def _sysfs(tmp_path: Path, siblings: list[list[int]]) -> Path:
    for core_id, threads in enumerate(siblings):
        for cpu in threads:
            topology = tmp_path / f"cpu{cpu}" / "topology"
            topology.mkdir(parents=True)
            (topology / "physical_package_id").write_text("0\n")
            (topology / "core_id").write_text(f"{core_id}\n")
    return tmp_path


@pytest.mark.parametrize(("siblings", "workers", "load", "gateway"), [
    # 8 cores of 2 threads numbered i and i + 8 (as most clouds do): each worker on a core of its own, its sibling idle
    ([[i, i + 8] for i in range(8)], 2, [0, 1, 2, 3], [6, 7]),
    ([[i, i + 8] for i in range(8)], 4, [0, 1, 2, 3], [4, 5, 6, 7]),
    # threads numbered side by side: without the topology, workers 2 would have been CPUs 4 and 5, one core
    ([[2 * i, 2 * i + 1] for i in range(8)], 2, [0, 2, 4, 6], [12, 14]),
    # 3 cores of 2: the load takes one core's two threads
    ([[0, 1], [2, 3], [4, 5]], 2, [0, 1], [2, 4]),
])
def test_with_smt_each_worker_has_a_physical_core_of_its_own(tmp_path: Path, siblings: list[list[int]], workers: int,
                                                              load: list[int], gateway: list[int]) -> None:
    import bench.gateway as harness
    cpus = sorted(c for core in siblings for c in core)
    cores = harness.physical_cores(cpus, _sysfs(tmp_path, siblings))
    assert sorted(map(sorted, cores)) == sorted(map(sorted, siblings))
    load_cpus, gw_cpus = harness._split_cpus(cpus, cores, workers)
    assert (load_cpus, gw_cpus) == (load, gateway)
    core_of = {cpu: i for i, core in enumerate(siblings) for cpu in core}
    assert len({core_of[c] for c in gw_cpus}) == workers
    assert not {core_of[c] for c in gw_cpus} & {core_of[c] for c in load_cpus}
