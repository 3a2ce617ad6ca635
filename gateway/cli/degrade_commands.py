"""`tiergate degrade …`: read and set the degradation level, on the state a running gateway follows."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from gateway.cli.options import data_dir_option, existing_data_dir, settings_from
from gateway.cli.state_files import NO_STATE, naming, require
from gateway.config_files import ConfigFileError, load_yaml
from gateway.ladder.config import Ladder
from gateway.ladder.controller import MIN_TTL_S, LadderChangeError, LadderController, check_reason
from gateway.ladder.signals import Signals
from gateway.settings import Settings
from gateway.stores import open_ladder_store
from gateway.tenants.keys import MAX_TTL_S


def _ladder(data_dir: Path | None, ladder_file: Path | None, *, reads: bool = False) -> tuple[Settings, Ladder]:
    """The settings and the ladder file a command works with, before any store is opened (opening one makes its
    file). A command that only `reads` finds no state file there and says so, making none (set and auto may: a
    level held before a gateway starts)."""
    settings = existing_data_dir(settings_from(data_dir=data_dir, ladder_file=ladder_file))
    if reads:
        require(settings.state_db, settings, data_dir, NO_STATE)
    try:
        return settings, load_yaml(settings.ladder_file, Ladder)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def _controller(data_dir: Path | None, settings: Settings, ladder: Ladder) -> Iterator[LadderController]:
    """The ladder over the gateway's store, closed after; a SQLite error names the file."""
    with naming(settings.state_db, settings, data_dir):
        store = open_ladder_store(settings)
        try:
            yield LadderController(ladder, store, Signals())
        finally:
            store.close()


def parse_ttl(text: str | None) -> float | None:
    """`90s`, `30m`, `2h`, `1d`, `1h30m` or plain seconds."""
    if text is None:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not parts or not any(parts.groups()):
        raise click.BadParameter(f"{text!r}: use 90s, 30m, 2h, 1d or 1h30m")
    d, h, m, s = (int(x or 0) for x in parts.groups())
    return float(d * 86400 + h * 3600 + m * 60 + s)


class Ttl(click.ParamType):
    """A manual level's TTL, checked where it is given: a refusal names `--ttl` (the controller's said `ttl_s`)."""

    name = "duration"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            seconds = parse_ttl(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)
        assert seconds is not None
        if not MIN_TTL_S <= seconds <= MAX_TTL_S:
            self.fail(f"{value!r} is not from 1s to 10 years (3650d)", param, ctx)
        return seconds


def _level(ladder: Ladder, text: str) -> int:
    """LEVEL as on-call types it: the level's number or its name in the ladder file."""
    for lv in ladder.levels:
        if text.strip().lower() in (str(lv.level), lv.name.lower()):
            return lv.level
    levels = ", ".join(f"{lv.level} {lv.name}" for lv in ladder.levels)
    raise click.BadParameter(f"no level {text!r} in the ladder; levels: {levels}", param_hint="'LEVEL'")


ladder_option = click.option("--ladder", "ladder_file", type=click.Path(path_type=Path), default=None,
                             help="Ladder file [env TIERGATE_LADDER_FILE; default degrade_ladder.yaml].")


@click.group()
def degrade() -> None:
    """The degradation ladder: levels that trade answers' quality for capacity under load (degrade_ladder.yaml).

    The gateway climbs and descends it by its triggers; on-call reads it (`status`: the level in force and every
    level's meaning), holds a level (`set LEVEL --reason R [--ttl 30m]`), hands it back to the triggers (`auto`)
    and reads every change (`history`). A running gateway follows within half a second.
    """


@degrade.command("status")
@ladder_option
@data_dir_option
def degrade_status(ladder_file: Path | None, data_dir: Path | None) -> None:
    """The level in force, who set it, and what it does."""
    with _controller(data_dir, *_ladder(data_dir, ladder_file, reads=True)) as c:
        s = c.status()
        click.echo(f"level {s['level']} ({s['name']}), set by {s['source']}")
        if s["manual"]:
            m = s["manual"]
            until = f"until {_utc(m['until'])}" if m["until"] else "until `auto`"
            click.echo(f"  manual: level {m['level']} by {m['by']} ({m['reason']}), {until}")
        click.echo(f"  triggers alone would choose level {s['auto_level']}")
        for action in s["actions"]:
            click.echo(f"  action: {json.dumps(action)}")
        click.echo("levels (`tiergate degrade set LEVEL --reason R` holds one):")
        for lv in c.ladder.levels:
            mark = "*" if lv.level == s["level"] else " "
            about = f": {lv.description}" if lv.description else ""
            click.echo(f" {mark} {lv.level} {lv.name}{about}")


@degrade.command("set")
@click.argument("level")
@click.option("--reason", required=True, help="Why, one line (kept in the audit trail).")
@click.option("--ttl", type=Ttl(), default=None,
              help="How long the level is held: seconds or 90s, 30m, 2h, 1d, 1h30m (1s to 10 years) "
                   "[default: until `tiergate degrade auto`].")
@ladder_option
@data_dir_option
def degrade_set(level: str, reason: str, ttl: float | None, ladder_file: Path | None, data_dir: Path | None) -> None:
    """Hold the ladder at LEVEL (its number or name: `degrade status` lists them); it outranks the triggers until
    the TTL ends or `auto` is set."""
    settings, ladder = _ladder(data_dir, ladder_file)
    number = _level(ladder, level)  # refused before the store is opened: a bad LEVEL or reason makes no state.db
    try:
        check_reason(reason)
    except LadderChangeError as exc:
        raise click.BadParameter(str(exc), param_hint="'--reason'") from exc
    with _controller(data_dir, settings, ladder) as c:
        try:
            c.set_manual(number, reason=reason, who="cli", ttl_s=ttl)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        until = _utc(time.time() + ttl) if ttl is not None else "`tiergate degrade auto`"
        click.echo(f"level {number} ({c.ladder.levels[number].name}) held until {until}")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@degrade.command("auto")
@ladder_option
@data_dir_option
def degrade_auto(ladder_file: Path | None, data_dir: Path | None) -> None:
    """Hand the ladder back to its triggers."""
    with _controller(data_dir, *_ladder(data_dir, ladder_file)) as c:
        c.set_auto(who="cli")
        click.echo(f"automatic; level {c.level}")


@degrade.command("history")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10_000),
              help="The latest this many changes, newest first.")
@ladder_option
@data_dir_option
def degrade_history(limit: int, ladder_file: Path | None, data_dir: Path | None) -> None:
    """Every change: when, from, to, who, why, and the metrics that triggered it."""
    with _controller(data_dir, *_ladder(data_dir, ladder_file, reads=True)) as c:
        events = c.store.history(limit)
        if not events:
            click.echo("no level changes recorded")
        for e in events:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.ts))
            metrics = f" {json.dumps(e.metrics)}" if e.metrics else ""
            click.echo(f"{when}  {e.from_level} -> {e.to_level}  by {e.who}: {e.reason}{metrics}")
