"""The one place the CLI turns a lower layer's error into one line on stderr and exit status 1.

A locked or read-only SQLite file, a PostgreSQL or Redis server that does not answer, a data directory that
cannot be made, bad TIERGATE_* settings: each is a message the operator can act on, never a traceback. Any
`user:password@` in a URL is blanked out of what is shown. An error of another kind is a bug and keeps its
traceback.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from gateway.errors import TiergateError


class StateFileError(Exception):
    """A SQLite error in one of the data directory's files: `path`, and `origin`, the setting that chose its
    directory (gateway/cli/state_files.py raises it; sqlite3's own errors say neither)."""

    def __init__(self, path: Path, origin: str, cause: sqlite3.Error) -> None:
        super().__init__(f"{path}: {cause}")
        self.path, self.origin, self.cause = path, origin, cause


def describe(exc: BaseException) -> str | None:
    """One line for an error the operator can act on; None for anything else (a bug: let it show)."""
    from psycopg import Error as PostgresError
    from redis.exceptions import RedisError

    from gateway.stores import DatabaseUnreachable
    from quotas.fault_log import redacted

    if isinstance(exc, click.ClickException | click.exceptions.Exit | click.exceptions.Abort):
        return None
    if isinstance(exc, TiergateError):
        text = exc.message
    elif isinstance(exc, DatabaseUnreachable):  # a store opened on the fleet database (it says which setting)
        text = f"PostgreSQL: {exc}; nothing was changed"
    elif isinstance(exc, StateFileError):
        text = _sqlite(exc.cause, f"{exc.path}", f" ({exc.origin})")
    elif isinstance(exc, sqlite3.Error):
        text = _sqlite(exc)
    elif isinstance(exc, PostgresError):
        text = f"PostgreSQL (TIERGATE_DATABASE_URL): {exc}; nothing was changed"
    elif isinstance(exc, RedisError):
        text = f"Redis (TIERGATE_REDIS_URL): {exc}; nothing was changed"
    elif isinstance(exc, ValidationError):
        text = settings_error(exc)
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    else:
        return None
    return redacted(text)


def settings_error(exc: ValidationError) -> str:
    """`TIERGATE_PORT: Input should be …` for each bad setting, without the value given (it may hold a password)."""
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not where:  # a rule across settings (it names them itself)
            parts.append(msg)
        else:
            parts.append(f"setting {where} (TIERGATE_{where.upper()}): {msg}" if exc.title == "Settings" else
                         f"{where}: {msg}")
    return "; ".join(parts)


def _sqlite(exc: sqlite3.Error, where: str = "SQLite", origin: str = "") -> str:
    """`where`: the file, when the store that failed is known; `origin`: the setting that chose it."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        return (f"{where}: {text}: another process (a running gateway?) held it for more than 5 s; nothing was "
                f"changed: retry{origin}")
    if "readonly" in text or "unable to open" in text:
        return (f"{where}: {text}: the data directory and its files must be writable by this user (SQLite's WAL "
                f"writes beside the database even to read){origin}")
    if "not a database" in text:
        return f"{where}: not a SQLite database{origin}: is this the gateway's data directory?"
    return f"{where}: {text}{origin}"


class TiergateGroup(click.Group):
    """The root command: every subcommand's operational errors end as one line (see the module docstring)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            message = describe(exc)
            if message is None:
                raise
            raise click.ClickException(message) from exc
