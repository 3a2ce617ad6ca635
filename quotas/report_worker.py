"""Usage reports in processes of their own: `python -m quotas.report_worker`, and the gateway's side of it.

A report reads and sums a tenant's whole history. On a thread of the gateway it held the gateway's interpreter
while it summed (measured: 500k rows, 3.2 s a report; another tenant's cache hits went from 4.2 to 14.7 ms at
p95 while one tenant looped its `/v1/usage`, where a separate process burning a whole core left them at
4.07 ms). Here a report process opens its own read-only connection to the ledger's database (its SQLite file or
its PostgreSQL URL, `Ledger.read_source()`), sums there, and sends back only the report's rows.

The processes are started with `python -m`, not by multiprocessing: spawn and forkserver import the parent's
`__main__` in every child (the whole gateway, or a script that starts one), where this imports the report's
modules only. One request at a time per process, over its stdin and stdout: a length (4 bytes, big-endian) and
a pickle. A process exits when its stdin closes (the gateway closed it, or died), and is replaced after
`tasks` reports so the memory a big report took goes back to the system.
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
TASKS_PER_PROCESS = 20  # reports a process answers before it is replaced
NICE = 10  # added to a report process's niceness
COMMAND = [sys.executable, "-m", "quotas.report_worker"]
_ROOT = str(Path(__file__).resolve().parent.parent)  # where `quotas` is imported from, for the child too


class ReportProcessFailed(RuntimeError):
    """A report process exited or broke the protocol before it answered."""


def main() -> None:
    """Answer reports until stdin closes: each request is (ReadSource, usage_report's keywords)."""
    from assets.parent_watch import exit_when_orphaned
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
            if not isinstance(exc, ValueError):
                log.exception("usage report failed")
            answer = ("error", exc)
        try:
            payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
            if answer[0] == "error":
                pickle.loads(payload)  # an error the gateway could not rebuild is sent as its words
        except Exception:
            payload = pickle.dumps(("error", ReportProcessFailed(f"{type(answer[1]).__name__}: {answer[1]}")))
        answers.write(_LENGTH.pack(len(payload)) + payload)
        answers.flush()


class ReportProcesses:
    """The gateway's report processes: `report` (a blocking call, on a report thread) takes an idle process or
    starts one, so there are as many as reports run at once (the report threads bound it), kept idle between
    reports and each replaced after `tasks`."""

    def __init__(self, *, tasks: int = TASKS_PER_PROCESS, command: list[str] | None = None) -> None:
        self.tasks = tasks
        self.command = command or COMMAND
        self._idle: list[_Process] = []
        self._busy: set[_Process] = set()
        self._lock = threading.Lock()
        self._closed = False

    def report(self, source: ReadSource, **query: Any) -> list[dict[str, Any]]:
        """`usage_report(**query)` on the ledger at `source`, in a report process; its error is raised here."""
        process = self._take()
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

    def _take(self) -> _Process:
        with self._lock:
            if self._closed:
                raise ReportProcessFailed("the report processes are closed")
            process = self._idle.pop() if self._idle else None
        if process is None:
            process = _Process(self.command)
        with self._lock:
            self._busy.add(process)
        return process

    def _give_back(self, process: _Process) -> None:
        with self._lock:
            self._busy.discard(process)
            keep = not self._closed and process.answered < self.tasks
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
        self.answered += 1
        return answer  # type: ignore[no-any-return]

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
