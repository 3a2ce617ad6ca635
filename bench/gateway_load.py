"""Load for bench/gateway.py: wrk for request/response paths, a small asyncio client for streams' first token.

wrk (C, one thread, keep-alive connections, closed loop: each connection sends its next request when the
last answer is complete) runs bench/gateway.lua, which prints one `BENCH_RESULT {json}` line; `parse_wrk`
reads it. wrk cannot see inside a response, so the streaming path uses `stream_probe`: the same closed loop
in Python (uvloop and httptools' parser), timing each stream's first content chunk and its end.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httptools

LUA = Path(__file__).with_name("gateway.lua")
RESULT_PREFIX = "BENCH_RESULT "
CONTENT = re.compile(rb'"content"\s*:\s*"(?!")')  # a chunk that carries text (not the empty role chunk)


@dataclass
class Cell:
    """One measurement: a target, a path, a concurrency."""

    target: str
    path: str
    concurrency: int
    seconds: float
    requests: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0  # connect, read, write and timeout errors, and answers that are not 2xx
    error_detail: dict[str, int] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)  # 2xx, other; x-tiergate-cache: hit, miss, bypass, none
    refusals: dict[str, int] = field(default_factory=dict)  # answers not 2xx, by "status error-code" (429 rate_limited)
    ttft_p50_ms: float | None = None  # streams: the first chunk with text
    ttft_p99_ms: float | None = None
    per_chunk_us: float | None = None  # streams: median of (end - first text) / (text chunks - 1)
    chunks_p50: float | None = None  # streams: text chunks per stream (a relay that merges chunks shows here)
    cpu_ms_per_request: float | None = None  # the target's processes' CPU time (user + system) per answer
    # CPU time of the load side (wrk, the mock, Redis, this harness) over the cell's wall time, in cores: what a
    # target sharing the load's core could not have
    load_cores: float | None = None
    round: int = 0  # `--rounds N`: which pass over the targets this cell was measured in (0 to N - 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], p: float) -> float:
    """wrk's percentile (stats.c): the smallest value whose cumulative count reaches round(p/100 * n + 0.5)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = math.floor(p / 100.0 * len(ordered) + 1.0)  # C's round(x + 0.5) for x >= 0 is floor(x + 1)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def parse_wrk(stdout: str, cell: Cell) -> Cell:
    """Fill `cell` from wrk's output: the BENCH_RESULT line that bench/gateway.lua's done() prints."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise ValueError(f"wrk printed no {RESULT_PREFIX.strip()} line:\n{stdout[-2000:]}")
    raw = json.loads(lines[-1][len(RESULT_PREFIX):])
    errors = dict(raw["errors"])
    cell.requests = int(raw["requests"])
    cell.rps = cell.requests / (raw["duration_us"] / 1e6) if raw["duration_us"] else 0.0
    cell.answers = {k: int(v) for k, v in raw["answers"].items()}
    cell.refusals = {k: int(v) for k, v in raw.get("refusals", {}).items()}
    # wrk's own status errors count 4xx and 5xx only; an answer that is not 2xx is an error here
    errors["status"] = max(errors["status"], cell.answers.get("other", 0))
    cell.error_detail = {k: int(v) for k, v in errors.items() if v}
    cell.errors = sum(cell.error_detail.values())
    lat = raw["latency_us"]
    if cell.requests:
        cell.p50_ms, cell.p99_ms = lat["p50"] / 1000.0, lat["p99"] / 1000.0
    return cell


def run_wrk(cell: Cell, url: str, *, key: str | None, body: dict[str, Any], unique: bool, nonce: int,
            timeout_s: float = 10.0) -> Cell:
    """Run wrk for one cell (one thread, `cell.concurrency` connections), on the caller's CPUs."""
    args = ["wrk", "-t1", f"-c{cell.concurrency}", f"-d{max(1, round(cell.seconds))}s", f"--timeout={timeout_s:g}s",
            "-s", str(LUA), url, "--", key or "-", json.dumps(body, separators=(",", ":")), "1" if unique else "0",
            str(nonce)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=cell.seconds + timeout_s + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout[-500:]}")
    return parse_wrk(proc.stdout, cell)


@dataclass
class StreamSample:
    ttft_s: float
    total_s: float
    num_chunks: int  # chunks with text


class _Conn(asyncio.Protocol):
    """One keep-alive connection; `ask` sends one request and returns its sample (or raises)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.status = 0
        self.body = bytearray()
        self.t0 = self.t_first = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionError("connection closed")
        if self.done is not None and not self.done.done():
            self.done.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done is not None and not self.done.done():
                self.done.set_exception(exc)

    def on_status(self, status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.t_first and CONTENT.search(body):
            self.t_first = time.perf_counter()
        self.body += body

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def ask(self, request: bytes, timeout_s: float) -> StreamSample:
        if self.lost is not None or self.transport is None:
            raise ConnectionError("connection closed")
        self.done = asyncio.get_running_loop().create_future()
        self.status, self.body, self.t_first = 0, bytearray(), 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.t0 = time.perf_counter()
        self.transport.write(request)
        await asyncio.wait_for(self.done, timeout_s)
        end = time.perf_counter()
        if self.status != 200:
            raise RuntimeError(f"status {self.status}: {bytes(self.body[:200])!r}")
        chunks = len(CONTENT.findall(bytes(self.body)))
        if not self.t_first or not chunks:
            raise RuntimeError("a stream with no text")
        return StreamSample(self.t_first - self.t0, end - self.t0, chunks)


def http_request(host: str, port: int, path: str, body: bytes, key: str | None) -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def _probe(cell: Cell, host: str, port: int, path: str, key: str | None, body: dict[str, Any], nonce: int,
                 timeout_s: float) -> tuple[list[StreamSample], dict[str, int], float]:
    template = json.dumps(body, separators=(",", ":"))
    loop = asyncio.get_running_loop()
    samples: list[StreamSample] = []
    errors = {"connect": 0, "status": 0, "timeout": 0, "read": 0}
    counter = 0
    stop = time.perf_counter() + cell.seconds

    async def worker(wid: int) -> None:
        nonlocal counter
        conn: _Conn | None = None
        while time.perf_counter() < stop:
            if conn is None or conn.lost is not None:
                try:
                    _, conn = await loop.create_connection(_Conn, host, port)
                except OSError:
                    errors["connect"] += 1
                    await asyncio.sleep(0.05)
                    continue
            counter += 1
            text = f"ask {nonce}-{wid}-{counter}: stream"
            request = http_request(host, port, path, template.replace("@UNIQUE@", text, 1).encode(), key)
            try:
                samples.append(await conn.ask(request, timeout_s))
            except TimeoutError:
                errors["timeout"] += 1
                if conn.transport is not None:
                    conn.transport.close()
                conn = None
            except RuntimeError:
                errors["status"] += 1
            except (ConnectionError, httptools.HttpParserError):
                errors["read"] += 1
                conn = None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(cell.concurrency)))
    return samples, errors, time.perf_counter() - t0


def stream_probe(cell: Cell, host: str, port: int, path: str, *, key: str | None, body: dict[str, Any], nonce: int,
                 timeout_s: float = 10.0) -> Cell:
    """Stream for `cell.seconds` on `cell.concurrency` connections; fill req/s, TTFT and per-chunk time."""
    import uvloop

    samples, errors, elapsed = uvloop.run(_probe(cell, host, port, path, key, body, nonce, timeout_s))
    cell.requests = len(samples)
    cell.rps = len(samples) / elapsed if elapsed else 0.0
    cell.error_detail = {k: v for k, v in errors.items() if v}
    cell.errors = sum(errors.values())
    cell.answers = {"2xx": len(samples), "other": errors["status"]}
    if samples:
        cell.ttft_p50_ms = 1000 * percentile([s.ttft_s for s in samples], 50)
        cell.ttft_p99_ms = 1000 * percentile([s.ttft_s for s in samples], 99)
        cell.p50_ms = 1000 * percentile([s.total_s for s in samples], 50)
        cell.p99_ms = 1000 * percentile([s.total_s for s in samples], 99)
        gaps = [(s.total_s - s.ttft_s) / max(1, s.num_chunks - 1) for s in samples]
        cell.per_chunk_us = 1e6 * percentile(gaps, 50)
        cell.chunks_p50 = percentile([s.num_chunks for s in samples], 50)
    return cell
