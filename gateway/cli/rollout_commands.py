"""`tiergate rollout …`: start, read and move rollouts of a tier's model versions, on the store a running gateway
follows (it takes effect there within seconds)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from gateway.cli.options import data_dir_option, existing_data_dir, settings_from
from gateway.cli.state_files import NO_STATE, naming, require
from gateway.config_files import ConfigFileError, load_yaml
from gateway.errors import TiergateError
from gateway.rollout.guards import guards_from, tier_guards_error
from gateway.rollout.service import RolloutService
from gateway.rollout.state import Rollout, RolloutEvent, RolloutStore
from gateway.settings import Settings
from gateway.stores import open_rollout_store, open_tenant_store
from tiers.catalogue import TierCatalogue

tiers_option = click.option("--tiers", "tiers_file", type=click.Path(path_type=Path), default=None,
                            help="Tiers file [env TIERGATE_TIERS_FILE; default tiers/tiers.yaml].")
reason_option = click.option("--reason", required=True, help="Why (kept in the audit trail).")


def _setup(data_dir: Path | None, tiers_file: Path | None, *, existing: bool = False
           ) -> tuple[Settings, TierCatalogue]:
    """The settings and the tiers file a command works with, checked before any store is opened (opening one makes
    state.db). A command that only reads, or changes a rollout that must be there already (`existing`), finds no
    state file there and says so, making none; `start` may make it (a rollout set before a gateway starts)."""
    settings = existing_data_dir(settings_from(data_dir=data_dir, tiers_file=tiers_file))
    if existing:
        require(settings.state_db, settings, data_dir, NO_STATE)
    try:
        catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    if (bad := tier_guards_error(catalogue)) is not None:  # RolloutService refuses it too, once the store is open
        raise click.ClickException(f"{settings.tiers_file}: {bad}")
    return settings, catalogue


@contextmanager
def _service(data_dir: Path | None, settings: Settings, catalogue: TierCatalogue) -> Iterator[RolloutService]:
    """The rollouts over the gateway's store, closed after; a SQLite error names the file."""
    with naming(settings.state_db, settings, data_dir), _one_line():
        service = RolloutService(catalogue, open_rollout_store(settings))
        try:
            yield service
        finally:
            service.store.close()


@contextmanager
def _one_line() -> Iterator[None]:
    """A change the rollouts refuse (a TiergateError) is the command's error, in one line."""
    try:
        yield
    except TiergateError as exc:
        raise click.ClickException(exc.message) from exc


class _Checked(Exception):
    """A dry run's change passed every check: it reached the store's save."""


class _NoRollouts(RolloutStore):
    """The state of a data directory that has none, for a dry run: no rollouts, no history, and a save that writes
    nothing (it raises _Checked)."""

    def load(self) -> dict[str, Rollout]:
        return {}

    def save(self, rollout: Rollout, event: RolloutEvent) -> bool:
        raise _Checked

    def history(self, tier: str | None = None, limit: int = 100) -> list[RolloutEvent]:
        return []


def _say(r: Rollout) -> None:
    share = f", share {r.share:.2%}" if r.stage in ("canary", "paused") else \
        f", shadowing {r.shadow:.2%} of requests" if r.stage == "shadow" else ""
    tenants = f", tenants {', '.join(r.tenants)}" if r.tenants and r.stage in ("canary", "paused") else ""
    click.echo(f"tier {r.tier}: {r.candidate} over {r.baseline}, {r.stage}{share}{tenants}")


@click.group()
def rollout() -> None:
    """Roll a tier's model version out in steps: start, status, promote, pause, rollback, history."""


@rollout.command("start")
@click.argument("tier")
@click.argument("version")
@click.option("--share", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of new conversations on VERSION (0 to 1).")
@click.option("--tenant", "tenants", multiple=True, help="A tenant always on VERSION (repeatable) [default: none].")
@click.option("--shadow", type=click.FloatRange(0, 1), default=None,
              help="A shadow instead of a canary: this share of requests is also sent to VERSION (never returned) "
                   "[default: a canary].")
@click.option("--max-error-rate", type=float, default=None,
              help="Guard: the candidate's 5xx rate [default: the tier's rollout_guards, else 0.05].")
@click.option("--max-ttft-ratio", "max_ttft_p95_ratio", type=float, default=None,
              help="Guard: its p95 TTFT over the baseline's [default: the tier's, else 1.5].")
@click.option("--max-tpot-ratio", "max_tpot_p95_ratio", type=float, default=None,
              help="Guard: its p95 TPOT over the baseline's [default: the tier's, else 1.5].")
@click.option("--max-divergence", type=float, default=None,
              help="Guard: shadowed answers' mean divergence [default: the tier's, else off].")
@click.option("--min-requests", type=int, default=None,
              help="Candidate requests in the window before judging [default: the tier's, else 50].")
@click.option("--window", "window_s", type=float, default=None,
              help="Seconds of outcomes a guard reads [default: the tier's, else 300].")
@click.option("--breach-for", "breach_for_s", type=float, default=None,
              help="Seconds a guard must stay breached before it rolls back [default: the tier's, else 30].")
@reason_option
@tiers_option
@data_dir_option
def rollout_start(tier: str, version: str, share: float, tenants: tuple[str, ...], shadow: float | None,
                  reason: str, tiers_file: Path | None, data_dir: Path | None, **guards: float | int | None) -> None:
    """A canary of VERSION on TIER (a share of new conversations, and every named tenant), or a shadow; its guards
    roll it back by themselves."""
    settings, catalogue = _setup(data_dir, tiers_file, existing=bool(tenants))  # named tenants: in state.db
    with _one_line():
        limits = guards_from({k: v for k, v in guards.items() if v is not None})

    def start(s: RolloutService) -> Rollout:
        return s.start(tier, version, share=share, tenants=tenants, who="cli", reason=reason, shadow=shadow,
                       guards=limits)

    if not settings.database_url and not settings.state_db.exists():
        # no state yet: the start is checked against none (a tier, version, share or reason it refuses makes no
        # state.db), then made for real
        with _one_line(), contextlib.suppress(_Checked):
            start(RolloutService(catalogue, _NoRollouts()))
    with _service(data_dir, settings, catalogue) as s:
        if tenants:  # a named tenant must exist, as the admin route checks
            store = open_tenant_store(settings)
            try:
                store.require_tenants(tenants, "tenants")
            finally:
                store.close()
        _say(start(s))


@rollout.command("status")
@tiers_option
@data_dir_option
def rollout_status(tiers_file: Path | None, data_dir: Path | None) -> None:
    """Each tier's latest rollout: its stage and share, and who changed it last and why."""
    with _service(data_dir, *_setup(data_dir, tiers_file, existing=True)) as s:
        found = s.status()
        for r in found:
            share = f" {r['share']:.2%}" if r["stage"] in ("canary", "paused") else \
                f" {r['shadow']:.2%}" if r["stage"] == "shadow" else ""
            tenants = f" + tenants {', '.join(r['tenants'])}" if r["tenants"] else ""
            click.echo(f"{r['tier']}: {r['candidate']} over {r['baseline']}, {r['stage']}{share}{tenants}; "
                       f"last changed by {r['changed_by']} ({r['reason']})")
            if r["guard"] is not None and r["guard"]["breached"]:
                click.echo(f"  guards breached: {'; '.join(r['guard']['breached'])}")
        if not found:
            click.echo("no rollouts")


@rollout.command("promote")
@click.argument("tier")
@click.option("--share", type=click.FloatRange(0, 1), default=None,
              help="A larger canary share instead of everyone (never smaller) [default: everyone].")
@reason_option
@tiers_option
@data_dir_option
def rollout_promote(tier: str, share: float | None, reason: str, tiers_file: Path | None,
                    data_dir: Path | None) -> None:
    """Everyone on the candidate (`full`), or a larger canary share; a paused canary resumes, a shadow becomes a
    canary."""
    with _service(data_dir, *_setup(data_dir, tiers_file, existing=True)) as s:
        _say(s.promote(tier, share=share, who="cli", reason=reason))


@rollout.command("pause")
@click.argument("tier")
@reason_option
@tiers_option
@data_dir_option
def rollout_pause(tier: str, reason: str, tiers_file: Path | None, data_dir: Path | None) -> None:
    """Hold the canary: each conversation stays on its version; the share is not raised until promoted. A shadow
    is not paused: roll it back, or promote it with a share."""
    with _service(data_dir, *_setup(data_dir, tiers_file, existing=True)) as s:
        _say(s.pause(tier, who="cli", reason=reason))


@rollout.command("rollback")
@click.argument("tier")
@reason_option
@tiers_option
@data_dir_option
def rollout_rollback(tier: str, reason: str, tiers_file: Path | None, data_dir: Path | None) -> None:
    """Everyone back on the version that answered before the rollout."""
    with _service(data_dir, *_setup(data_dir, tiers_file, existing=True)) as s:
        _say(s.rollback(tier, who="cli", reason=reason))


@rollout.command("history")
@click.option("--tier", default=None, help="One tier's changes only [default: every tier].")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10_000),
              help="The latest this many changes, newest first.")
@tiers_option
@data_dir_option
def rollout_history(tier: str | None, limit: int, tiers_file: Path | None, data_dir: Path | None) -> None:
    """Every change: when, which tier and version, the stage and share it left, who and why."""
    with _service(data_dir, *_setup(data_dir, tiers_file, existing=True)) as s:
        events = s.history(tier, limit)
        if not events and tier is not None and tier not in s.catalogue.tiers:  # misspelt: no tier, not no changes
            raise click.ClickException(f"no tier {tier!r} in the tiers file, nor rollouts of one; tiers: "
                                       f"{', '.join(s.catalogue.tiers)}")
        if not events:
            click.echo(f"no rollout changes{f' of tier {tier}' if tier else ''}")
        for e in events:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.ts))
            click.echo(f"{when}  {e.tier} {e.action} {e.candidate}: {e.stage} share {e.share:.2%}  "
                       f"by {e.who}: {e.reason}")
