"""bench/gateway.py's report: the machine it ran on, then one markdown table per path, with the ratios.

Ratios compare cells of the same run only: Tiergate's req/s over LiteLLM's at the same path and concurrency,
over the reference commit's (`--compare-ref`), and each gateway's p50 at c=1 minus the mock alone's
("added p50": what the gateway costs a request when nothing queues).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from bench.gateway_load import Cell

MOCK = "mock alone"
MIN_MOCK_HEADROOM = 5.0  # the mock must serve at least this many times the fastest gateway cell's rate
FEW = 100  # answers in a cell below which its p99 is little more than its maximum


class PathLike(Protocol):
    key: str
    title: str
    stream: bool


def machine_info(load_cpus: list[int], gw_cpus: list[int]) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(re.findall(r"\b(avx512\w*|amx\w*)\b", cpuinfo))
    # redis_client's report shares this header and runs no wrk: a machine without one says so
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines() if shutil.which("wrk") \
        else ["not installed"]
    return {
        "cpu": model.group(1).strip() if model else platform.processor() or "unknown",
        "avx512": sorted(f for f in flags if f.startswith("avx512")),
        "amx": sorted(f for f in flags if f.startswith("amx")),
        "cpus_online": os.cpu_count(),
        "load_cpus": load_cpus,
        "gateway_cpus": gw_cpus,
        "threads_per_core": _threads_per_core(),
        "python": platform.python_version(),
        "wrk": wrk[0].split(" [")[0] if wrk else "unknown",
        "loadavg_at_start": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def _threads_per_core() -> int | None:
    """CPU 0's hardware threads (2 with SMT), from sysfs; None where it cannot be read."""
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None
    count = 0
    for part in siblings.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def collapse(cells: list[Cell]) -> list[Cell]:
    """One cell per target, path and concurrency (in the order first measured): each figure the median of its
    rounds (`--rounds`), counts summed. A cell measured once is returned as it is."""
    groups: dict[tuple[str, str, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.target, cell.path, cell.concurrency), []).append(cell)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        answers, errors, refusals = (_summed([getattr(c, name) for c in group])
                                     for name in ("answers", "error_detail", "refusals"))
        median = {name: _median([getattr(c, name) for c in group])
                  for name in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "per_chunk_us", "chunks_p50",
                               "cpu_ms_per_request", "load_cores")}
        out.append(replace(group[0], seconds=sum(c.seconds for c in group), requests=sum(c.requests for c in group),
                           rps=statistics.median(c.rps for c in group), errors=sum(c.errors for c in group),
                           error_detail=errors, answers=answers, refusals=refusals, round=-1, **median))
    return out


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for k, v in one.items():
            total[k] = total.get(k, 0) + v
    return total


def _find(cells: list[Cell], target_prefix: str, path: str, c: int) -> Cell | None:
    return next((x for x in cells if x.target.startswith(target_prefix) and x.path == path and x.concurrency == c),
                None)


def _ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.1f}")


def _rate(cell: Cell) -> str:
    return f"{cell.rps:,.0f}" + ("*" if cell.requests < FEW else "")


def _ratio(a: Cell | None, b: Cell | None) -> str:
    return f"{a.rps / b.rps:.2f}x" if a and b and b.rps else "—"


def _answers(cell: Cell) -> str:
    a = cell.answers
    parts = [f"{a.get('2xx', 0)} ok"]
    if a.get("other"):
        why = ", ".join(f"{k}: {v}" for k, v in sorted(cell.refusals.items()))
        parts.append(f"{a['other']} not 2xx" + (f" ({why})" if why else ""))
    parts += [f"{a[k]} {k}" for k in ("hit", "miss", "bypass") if a.get(k)]
    return ", ".join(parts)


def _errors(cell: Cell) -> str:
    detail = ", ".join(f"{k} {v}" for k, v in cell.error_detail.items())
    return f"{cell.errors} ({detail})" if cell.errors else "0"


def _header(info: dict[str, Any], args: argparse.Namespace, cells: list[Cell], command: str) -> list[str]:
    avx = ", ".join(info["avx512"]) or "none"
    amx = ", ".join(info["amx"]) or "none"
    lines = [
        "# Gateway overhead (bench/gateway.py)", "", f"`{command}` — {info['date']}, {info['wall_s']} s", "",
        f"- CPU: {info['cpu']}; AVX-512: {'yes' if info['avx512'] else 'no'} ({avx}); "
        f"AMX: {'yes' if info['amx'] else 'no'} ({amx})",
        f"- {info['cpus_online']} CPUs online. The gateway under test (Tiergate, LiteLLM, the reference commit, one "
        f"at a time) is pinned to CPU {','.join(map(str, info['gateway_cpus']))}; wrk, the mock upstream and this "
        f"harness to CPU {','.join(map(str, info['load_cpus']))} (taskset); "
        f"{info.get('threads_per_core') or '?'} hardware thread(s) per core (with SMT, each gateway CPU is on a core "
        "of its own, its sibling idle).",
        f"- Python {info['python']}; {info['wrk']}; load average {info['loadavg_at_start']} at the start, "
        f"{info.get('loadavg_at_end', '?')} at the end (other work on the machine makes every number noisy: "
        "measure on a quiet one).",
        f"- Each cell {args.seconds:g} s after {args.warmup:g} s of warm-up at c=16; answers of {args.tokens} tokens "
        f"(streams: {args.stream_tokens}); model `{args.model}`; {args.workers} gateway worker(s).",
        "- Paths a-c: wrk, one thread, closed loop; p50/p99 from wrk's histogram (with its coordinated-omission "
        "correction). Path d: an asyncio client (uvloop, httptools), closed loop, same percentile rule. "
        f"`*`: fewer than {FEW} answers in the cell, its percentiles are rough.",
    ]
    if info.get("load_shares_gateway_cpu"):
        lines.append("- **The load generator shares a CPU with the gateway** (fewer CPUs than workers + 1): this run "
                     "shows that the workers serve, not how they scale.")
    if info.get("honoured_settings") or info.get("overridden_settings"):
        lines.append(f"- TIERGATE_* from the environment: honoured {info['honoured_settings'] or 'none'}; "
                     f"set by the harness instead {info['overridden_settings'] or 'none'}.")
    for kind, mock_path, gw_paths in (("requests", "a", "abc"), ("streams", "d", "d")):
        mock_best = max((c.rps for c in cells if c.target == MOCK and c.path == mock_path), default=0.0)
        gw_best = max((c.rps for c in cells if c.target != MOCK and c.path in gw_paths), default=0.0)
        if mock_best and gw_best:
            headroom = mock_best / gw_best
            verdict = "ok" if headroom >= MIN_MOCK_HEADROOM else f"BELOW the {MIN_MOCK_HEADROOM:g}x needed: suspect"
            lines.append(f"- Mock upstream alone ({kind}): up to {mock_best:,.0f}/s on the load core, "
                         f"{headroom:.1f}x the fastest gateway cell ({gw_best:,.0f}/s): {verdict}.")
    return lines


def _cpu(cell: Cell) -> str:
    return "—" if cell.cpu_ms_per_request is None else f"{cell.cpu_ms_per_request:.2f}"


def _cpu_ratio(ours: Cell, other: Cell | None) -> str:
    """How many times less CPU per answer ours takes (above 1: cheaper)."""
    if other is None or not ours.cpu_ms_per_request or other.cpu_ms_per_request is None:
        return "—"
    return f"{other.cpu_ms_per_request / ours.cpu_ms_per_request:.2f}x"


def _in_order(cells: list[Cell], path: str) -> list[Cell]:
    """A path's cells, target by target (in the order each was first measured), then by concurrency."""
    first: dict[str, int] = {}
    for i, cell in enumerate(cells):
        first.setdefault(cell.target, i)
    return sorted((x for x in cells if x.path == path), key=lambda x: (first[x.target], x.concurrency))


def _comparisons(cell: Cell, cells: list[Cell], path: str, ref: str | None) -> tuple[str, str, str]:
    """vs LiteLLM (req/s), vs ref (req/s), CPU per answer vs ref, for our cells; dashes for the others."""
    if not cell.target.startswith("Tiergate") or cell.target.endswith("(ref)"):
        return "—", "—", "—"
    ref_cell = _find(cells, ref, path, cell.concurrency) if ref else None
    return (_ratio(cell, _find(cells, "LiteLLM", path, cell.concurrency)), _ratio(cell, ref_cell),
            _cpu_ratio(cell, ref_cell))


def _plain_table(path: PathLike, cells: list[Cell], ref: str | None) -> list[str]:
    lines = ["| target | c | req/s | p50 ms | p99 ms | CPU ms/req | errors | answers | vs LiteLLM | vs ref | "
             "CPU vs ref |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in _in_order(cells, path.key):
        lite, vs_ref, cpu_ref = _comparisons(cell, cells, path.key, ref)
        lines.append(f"| {cell.target} | {cell.concurrency} | {_rate(cell)} | {_ms(cell.p50_ms)} | "
                     f"{_ms(cell.p99_ms)} | {_cpu(cell)} | {_errors(cell)} | {_answers(cell)} | {lite} | {vs_ref} | "
                     f"{cpu_ref} |")
    return lines


def _stream_table(path: PathLike, cells: list[Cell], ref: str | None) -> list[str]:
    lines = ["| target | c | streams/s | TTFT p50 ms | TTFT p99 ms | stream p50 ms | stream p99 ms | per chunk µs | "
             "text chunks | CPU ms/stream | errors | vs LiteLLM | vs ref | CPU vs ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in _in_order(cells, path.key):
        lite, vs_ref, cpu_ref = _comparisons(cell, cells, path.key, ref)
        chunk = "—" if cell.per_chunk_us is None else f"{cell.per_chunk_us:.0f}"
        chunks = "—" if cell.chunks_p50 is None else f"{cell.chunks_p50:g}"
        lines.append(f"| {cell.target} | {cell.concurrency} | {_rate(cell)} | {_ms(cell.ttft_p50_ms)} | "
                     f"{_ms(cell.ttft_p99_ms)} | {_ms(cell.p50_ms)} | {_ms(cell.p99_ms)} | {chunk} | {chunks} | "
                     f"{_cpu(cell)} | {_errors(cell)} | {lite} | {vs_ref} | {cpu_ref} |")
    return lines


def _added(path: PathLike, cells: list[Cell]) -> str:
    """Each gateway's p50 (streams: TTFT p50 and per-chunk time) at c=1 over the mock alone's on the same path
    (path b, which the mock cannot tell from a, over its path a)."""
    base = _find(cells, MOCK, path.key, 1) or _find(cells, MOCK, "a", 1) or _find(cells, MOCK, "c", 1)
    if base is None or base.p50_ms is None:
        return ""
    out = []
    for cell in (x for x in cells if x.path == path.key and x.concurrency == 1 and x.target != MOCK):
        if path.stream and cell.ttft_p50_ms is not None and base.ttft_p50_ms is not None:
            chunk = (cell.per_chunk_us or 0) - (base.per_chunk_us or 0)
            out.append(f"{cell.target} +{cell.ttft_p50_ms - base.ttft_p50_ms:.2f} ms TTFT, {chunk:+.0f} µs per chunk")
        elif not path.stream and cell.p50_ms is not None:
            out.append(f"{cell.target} +{cell.p50_ms - base.p50_ms:.2f} ms")
    what = f"TTFT p50 {base.ttft_p50_ms:.2f} ms" if path.stream else f"p50 {base.p50_ms:.2f} ms"
    return f"Added at c=1 over the mock alone ({what}): " + "; ".join(out) + "." if out else ""


def _scaling(path: PathLike, cells: list[Cell], workers: int) -> str:
    """`--workers N`: Tiergate's N workers over its 1 worker, per concurrency (cells measured alternately), round
    by round, and the load side's cores during the N-worker cells."""
    if workers < 2:
        return ""
    pairs, shared = [], []
    for c in sorted({x.concurrency for x in cells if x.path == path.key and x.target.endswith(" 1 worker")}):
        ratios, loads = [], []
        for one in (x for x in cells if x.path == path.key and x.concurrency == c and x.target.endswith(" 1 worker")):
            many = next((x for x in cells if x.target == one.target.removesuffix(" 1 worker") + f" {workers} workers"
                         and x.path == path.key and x.concurrency == c and x.round == one.round), None)
            if many is not None and one.rps:
                ratios.append(many.rps / one.rps)
                if many.load_cores is not None:
                    loads.append(many.load_cores)
        if not ratios:
            continue
        each = ", ".join(f"{r:.2f}x" for r in ratios)
        pairs.append(f"c={c} {each}" + (f" (median {statistics.median(ratios):.2f}x)" if len(ratios) > 1 else ""))
        if loads:
            shared.append(f"c={c} {', '.join(f'{v:.2f}' for v in loads)}")
    if not pairs:
        return ""
    line = (f"Tiergate's {workers} workers ({workers} cores) over its 1 worker (1 core), req/s, round by round: "
            f"{'; '.join(pairs)}.")
    if shared:
        line += (f" The load side (wrk, the mock, Redis, this harness) used, in cores, during the {workers}-worker "
                 f"cells: {'; '.join(shared)}; where it shares a core with the workers, they had that much less "
                 f"than {workers} cores.")
    return line


def render(info: dict[str, Any], args: argparse.Namespace, paths: list[PathLike], cells: list[Cell],
           skipped: dict[str, str], command: str) -> str:
    ref = next((c.target for c in cells if c.target.endswith("(ref)")), None)
    each, cells = cells, collapse(cells)  # the tables give medians of the rounds; the scaling line every round
    lines = _header(info, args, cells, command)
    if getattr(args, "rounds", 1) > 1:
        lines.append(f"- {args.rounds} rounds: every figure in the tables is the median of a cell's rounds (answers "
                     "and errors summed); the targets took turns round by round.")
    for path in paths:
        lines += ["", f"## {path.title}", ""]
        lines += _stream_table(path, cells, ref) if path.stream else _plain_table(path, cells, ref)
        if added := _added(path, cells):
            lines += ["", added]
        if scaled := _scaling(path, each, args.workers):
            lines += ["", scaled]
    if any(c.path == "b" for c in cells) and not any(c.path == "b" and c.target.startswith("LiteLLM") for c in cells):
        lines += ["", "LiteLLM has no answer cache configured (no Redis, no database): path (b) is Tiergate's only."]
    if skipped:
        lines += ["", "## Not measured", ""] + [f"- {name}: {why[:1500]}" for name, why in skipped.items()]
    return "\n".join(lines) + "\n"
