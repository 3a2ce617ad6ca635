"""Options shared by several commands, and turning them into Settings."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from assets.torch_device import device_problem
from gateway.settings import Settings


def data_dir_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                        help="State and prepared models [env TIERGATE_DATA_DIR; default ~/.local/share/tiergate].")(fn)


class FiniteFloat(click.FloatRange):
    """click's FloatRange, less NaN and infinity (which pass its bounds: every comparison with NaN is false)."""

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


THREADS = click.IntRange(min=1)  # torch refuses 0 or fewer threads only once the model is loaded


def settings_from(**overrides: Any) -> Settings:
    """Settings from the environment, with the flags the user gave on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def existing_data_dir(settings: Settings) -> Settings:
    """`settings`, once its data directory is known to exist where the state lives there (no database URL).

    A command that reads or changes what is there never makes a new, empty one: a mistyped --data-dir (or a
    TIERGATE_DATA_DIR not set in this shell) would answer "no tenants", "no key" or "no usage", and leave a
    directory behind.
    """
    path = settings.data_dir
    if not settings.database_url and not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise click.ClickException(f"data directory {path} {what}: give the gateway's with --data-dir or "
                                   "TIERGATE_DATA_DIR")
    return settings


def check_device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """cpu, or cuda[:N] where this torch sees that GPU (assets/torch_device.py): refused here, not as a traceback once
    a model loads."""
    if (problem := device_problem(value)) is not None:
        raise click.BadParameter(f"{value!r}: {problem}")
    return value


def writable_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A file path whose directory exists and is writable, or can be made: refused before any work, not after it.
    Nothing is made here."""
    if value is None:
        return None
    if value.is_dir():
        raise click.BadParameter(f"{value} is a directory; give a file path")
    ancestor = value.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise click.BadParameter(f"{value}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK) or (value.exists() and not os.access(value, os.W_OK)):
        raise click.BadParameter(f"{value}: {value if value.exists() else ancestor} is not writable by this user")
    return value
