"""The data directory's SQLite files as the CLI opens them: an error in one names the file, and the setting that
chose its directory (the driver's own message names neither); a command that only reads (a list, a status, a
report, a history) never makes one (opening a store creates its file)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from gateway.cli.errors import StateFileError
from gateway.settings import Settings


def origin(settings: Settings, flag: Path | None) -> str:
    """Where the data directory came from, as the operator would change it."""
    if flag is not None:
        return f"--data-dir {flag}"
    default = Settings.model_fields["data_dir"].get_default(call_default_factory=True)
    if settings.data_dir == default:
        return "TIERGATE_DATA_DIR unset: the default"
    return f"TIERGATE_DATA_DIR={settings.data_dir}"


# what a missing file means, for the one line that refuses to read it
NO_STATE = "no state at {path}: no gateway has run on this data directory and nothing was set up in it"
NO_LEDGER = "no ledger at {path}: nothing has been served from this data directory"


def require(path: Path, settings: Settings, flag: Path | None, missing: str) -> None:
    """`path` must already be there (a database URL: the state is not in files): a command that reads it would
    otherwise make it and answer "no tenants", "no usage" or "level 0" of a data directory no gateway uses. Exit
    status 1, like every other refusal; nothing is made."""
    if settings.database_url or path.exists():
        return
    raise click.ClickException(f"{missing.format(path=path)} ({origin(settings, flag)}); nothing was made")


@contextmanager
def naming(path: Path, settings: Settings, flag: Path | None) -> Iterator[None]:
    """A SQLite error while `path` is opened or used is a StateFileError naming it (a database URL: no file)."""
    try:
        yield
    except sqlite3.Error as exc:
        if settings.database_url:
            raise
        raise StateFileError(path, origin(settings, flag), exc) from exc
