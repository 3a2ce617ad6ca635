"""Options shared by several commands, and turning them into Settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gateway.settings import Settings


def data_dir_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                        help="State and prepared models [env TIERGATE_DATA_DIR; default ~/.local/share/tiergate].")(fn)


def settings_from(**overrides: Any) -> Settings:
    """Settings from the environment, with the flags the user gave on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
