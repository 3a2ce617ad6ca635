"""Usage reports in processes of their own: `python -m quotas.report_worker`, and the gateway's side of it.

A report reads and sums a tenant's whole history. On a thread of the gateway it held the gateway's interpreter
while it summed (measured: 500k rows, 3.2 s a report; another tenant's cache hits went from 4.2 to 14.7 ms at
p95 while one tenant looped its `/v1/usage`, where a separate process burning a whole core left them at
4.07 ms). Here a report process opens its own read-only connection to the ledger's database (its SQLite file or
its PostgreSQL URL, `Ledger.read_source()`), sums there, and sends back only the report's rows.

The processes are started with `python -m`, not by multiprocessing: spawn and forkserver import the parent's
`__main__` in every child (the whole gateway, or a script that starts one), where this imports the report's
modules only. One request at a time per process, over its stdin and stdout: a length (4 bytes, big-endian) and
a pickle. A process exits when its stdin closes (the gateway closed it, or died). It keeps the closed days' sums
of the reports it made (quotas/report_rollups.py), so it lives long: it is replaced after `tasks` reports, or
sooner once its resident memory passes `max_rss` (what a big report took goes back to the system), and a tenant's
report goes to the idle process that made that tenant's last one, where its days are kept.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from quotas.ledger_reads import ReadSource

log = logging.getLogger("tiergate.report")
_LENGTH = struct.Struct(">I")
TASKS_PER_PROCESS = 1000  # reports a process answers before it is replaced (20 before it kept day sums)
MAX_RSS = 512 * 2**20  # a process whose resident memory passes this after a report is replaced (kept sums: ~60 MiB)
NICE = 10  # added to a report process's niceness
COMMAND = [sys.executable, "-m", "quotas.report_worker"]
_ROOT = str(Path(__file__).resolve().parent.parent)  # where `quotas` is imported from, for the child too


class ReportProcessFailed(RuntimeError):
    """A report process exited or broke the protocol before it answered."""


def main() -> None:
    """Answer reports until stdin closes: each request is (ReadSource, usage_report's keywords); each answer is
    ("ok", rows) or ("error", exception), and the process's resident memory after it."""
    from assets.parent_watch import exit_when_orphaned
    from quotas.ledger_reads import read_fault
    from quotas.report import report_at

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the gateway's terminal: the gateway says when to stop
    with suppress(OSError):
        os.nice(NICE)  # a report is batch work: on a busy host, requests get the CPU first
    exit_when_orphaned()  # the gateway died (even SIGKILLed) during a long report: stop it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s report process %(name)s: %(message)s")
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the answers' pipe
    while (request := _read(requests)) is not None:
        source, query = request
        try:
            answer: tuple[str, Any] = ("ok", report_at(ReadSource(*source), **query))
        except Exception as exc:
            # a refused query (ValueError) is the caller's to say; a read the database cannot answer now (its outage)
            # is logged once by the gateway's ReportGate, not with a traceback a report here
            if not isinstance(exc, ValueError) and not read_fault(exc):
                log.exception("usage report failed")
            answer = ("error", exc)
        try:
            payload = pickle.dumps((*answer, _rss()), protocol=pickle.HIGHEST_PROTOCOL)
            if answer[0] == "error":
                pickle.loads(payload)  # an error the gateway could not rebuild is sent as its words
        except Exception:
            payload = pickle.dumps(("error", ReportProcessFailed(f"{type(answer[1]).__name__}: {answer[1]}"), _rss()))
        answers.write(_LENGTH.pack(len(payload)) + payload)
        answers.flush()


class ReportProcesses:
    """The gateway's report processes: `report` (a blocking call, on a report thread) takes an idle process (the
    one that made the same tenant's last report, if idle) or starts one, so there are as many as reports run at
    once (the report threads bound it), kept idle between reports and each replaced after `tasks` or once its
    memory passes `max_rss`."""

    def __init__(self, *, tasks: int = TASKS_PER_PROCESS, command: list[str] | None = None,
                 max_rss: int = MAX_RSS) -> None:
        self.tasks = tasks
        self.max_rss = max_rss
        self.command = command or COMMAND
        self._idle: list[_Process] = []
        self._busy: set[_Process] = set()
        self._lock = threading.Lock()
        self._closed = False

    def report(self, source: ReadSource, **query: Any) -> list[dict[str, Any]]:
        """`usage_report(**query)` on the ledger at `source`, in a report process; its error is raised here."""
        process = self._take((tuple(source), query.get("tenant")))
        try:
            kind, value = process.ask((tuple(source), query))
        except BaseException:
            process.kill()
            process.close_pipes()
            with self._lock:
                self._busy.discard(process)
            raise
        self._give_back(process)
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in (*self._idle, *self._busy)]

    def close(self) -> None:
        """Stop every process, those running a report too (their callers get ReportProcessFailed)."""
        with self._lock:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
        for process in idle:
            process.kill()
            process.close_pipes()
        for process in busy:  # its caller, reading its answer, closes its pipes
            process.kill()

    def _take(self, last: Any) -> _Process:
        """An idle process, the one whose last report was for `last` (ledger and tenant) if there is one."""
        with self._lock:
            if self._closed:
                raise ReportProcessFailed("the report processes are closed")
            same = [i for i, p in enumerate(self._idle) if p.last == last]
            process = self._idle.pop(same[-1] if same else -1) if self._idle else None
        if process is None:
            process = _Process(self.command)
        process.last = last
        with self._lock:
            self._busy.add(process)
        return process

    def _give_back(self, process: _Process) -> None:
        with self._lock:
            self._busy.discard(process)
            keep = not self._closed and process.answered < self.tasks and process.rss <= self.max_rss
            if keep:
                self._idle.append(process)
        if not keep:
            process.stop()


class _Process:
    def __init__(self, command: list[str]) -> None:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else "")}
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.pid = self._proc.pid
        self.answered = 0
        self.rss = 0  # bytes resident after its last answer
        self.last: Any = None  # what its last report was for

    def ask(self, request: Any) -> tuple[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            stdin.write(_LENGTH.pack(len(payload)) + payload)
            stdin.flush()
        except OSError as exc:
            raise ReportProcessFailed(f"the report process {self.pid} exited ({self._proc.poll()})") from exc
        answer = _read(stdout)
        if answer is None:
            raise ReportProcessFailed(f"the report process {self.pid} exited ({self._proc.wait()}) before it answered")
        kind, value, self.rss = answer
        self.answered += 1
        return kind, value

    def stop(self) -> None:
        """Close its stdin (it exits at once when idle) and reap it."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.close_pipes()

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close_pipes(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with suppress(OSError):
                    pipe.close()


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is not)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _read(stream: IO[bytes]) -> Any:
    """One message, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        return None
    return pickle.loads(body)  # our own report process, over its own pipe


if __name__ == "__main__":
    main()
