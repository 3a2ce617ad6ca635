"""A real PostgreSQL server for the tests, on a free loopback port: initdb, then `postgres` as a child process.

As the Redis tests start redis-server, these start Debian's PostgreSQL (`apt-get install postgresql`; .ci/run
does it). PostgreSQL refuses to run as root, which is what CI and the sandbox run as: the server then runs as
the `postgres` user the package creates (else `nobody`), in a data directory made theirs. Nothing is
skipped: if the server cannot start, the fixture fails and says why.

Each test gets a database of its own (`database_url`), created from an empty template and dropped after it.
`ledger_store` runs a test on both ledgers: the SQLite file and a PostgreSQL database.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from quotas.ledger import Ledger
from quotas.ledger_postgres import PostgresLedger
from tests.stubs import free_port


def pg_bindir() -> Path:
    """Where initdb and postgres are: `pg_config --bindir`, else Debian's /usr/lib/postgresql/<newest>/bin."""
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out and (Path(out) / "initdb").exists():
            return Path(out)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    return Path(found[-1]).parent


class PostgresServer:
    """`postgres` on 127.0.0.1:<free port>, trust authentication, superuser `tiergate`."""

    def __init__(self, *, fsync: bool = False) -> None:
        self.port = free_port()
        self.bindir = pg_bindir()
        self.fsync = fsync  # off for the tests (nothing crashes the server); on for benchmarks
        self.dir = Path(tempfile.mkdtemp(prefix="tiergate-pg-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = None if os.geteuid() != 0 else ("postgres" if _has_user("postgres") else "nobody")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://tiergate@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        """initdb (the first time), then the server; returns once it accepts connections."""
        data, log = self.dir / "data", self.dir / "server.log"
        if self.user is not None:  # the server's own user must own its directory
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        if not data.exists():
            init = subprocess.run([str(self.bindir / "initdb"), "-D", str(data), "-U", "tiergate", "--auth=trust",
                                   "-E", "UTF8", "--no-sync", "--no-instructions"], capture_output=True, text=True,
                                  user=self.user, cwd=self.dir, check=False)
            if init.returncode != 0:
                raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr.strip()[-2000:]}")
        options = ["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=", "-c", "max_connections=300",
                   "-c", f"fsync={'on' if self.fsync else 'off'}", "-c", "shared_buffers=64MB"]
        if not self.fsync:
            options += ["-c", "full_page_writes=off"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port),
                                          *options], stdout=out, stderr=subprocess.STDOUT, user=self.user,
                                         cwd=self.dir)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited ({self.proc.returncode}): {log.read_text()[-2000:]}")
            try:
                with psycopg.connect(self.url(), connect_timeout=1):
                    return self
            except psycopg.OperationalError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"postgres did not accept connections in 30 s: {log.read_text()[-2000:]}")

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")

    def stop(self, *, keep: bool = False) -> None:
        """Stop the server; `keep` its data for a `start` again (an outage and a recovery)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # a fast shutdown: clients still connected are cut off
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer().start()
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL could not start: {exc}")
    yield server
    server.stop()


@pytest.fixture
def database_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh database of the test's own on the session's server."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


class LedgerStore:
    """Where a test's ledger lives, SQLite file or PostgreSQL database: opens ledgers on it and runs raw SQL."""

    def __init__(self, kind: str, tmp_path: Path, url: str | None) -> None:
        self.kind = kind
        self.target = str(tmp_path / "ledger.db") if url is None else url  # what a subprocess is given

    def open(self, **kwargs: Any) -> Ledger:
        return open_ledger_at(self.target, **kwargs)

    def sql(self, statement: str) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            with sqlite3.connect(self.target) as conn:
                return conn.execute(statement).fetchall()
        with psycopg.connect(self.target, autocommit=True) as conn:
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else []


def open_ledger_at(target: str, **kwargs: Any) -> Ledger:
    """The ledger at a SQLite path or a postgresql:// URL."""
    if target.startswith("postgresql://"):
        return PostgresLedger(target, **kwargs)
    return Ledger(Path(target), **kwargs)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_store(request: pytest.FixtureRequest, tmp_path: Path) -> LedgerStore:
    url = request.getfixturevalue("database_url") if request.param == "postgres" else None
    return LedgerStore(request.param, tmp_path, url)
