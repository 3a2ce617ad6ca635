"""The data directory's SQLite files as the CLI opens them: an error in one names the file, and the setting that
chose its directory (the driver's own message names neither)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


@contextmanager
def naming(path: Path, settings: Settings, flag: Path | None) -> Iterator[None]:
    """A SQLite error while `path` is opened or used is a StateFileError naming it (a database URL: no file)."""
    try:
        yield
    except sqlite3.Error as exc:
        if settings.database_url:
            raise
        raise StateFileError(path, origin(settings, flag), exc) from exc
