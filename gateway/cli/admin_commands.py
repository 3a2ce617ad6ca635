"""`tiergate tenants|keys|usage`: act directly on the state a running gateway uses."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from pydantic import ValidationError

from gateway.cli.options import data_dir_option, existing_data_dir, settings_from
from gateway.cli.state_files import NO_LEDGER, NO_STATE, naming, require
from gateway.config_files import ConfigFileError, load_yaml
from gateway.errors import TiergateError
from gateway.report_format import to_csv, to_json, to_table
from gateway.report_params import parse_by, parse_day
from gateway.settings import Settings
from gateway.stores import open_ledger, open_tenant_store
from gateway.tenants.keys import MAX_GRACE_S, MAX_TTL_S, MIN_KEY_TTL_S, check_seconds, parse_duration
from gateway.tenants.records import ADMIN
from gateway.tenants.store import TenantStore
from quotas.plans import MAX_BUDGET_USD, MAX_CONCURRENT, MAX_RPM, MAX_TPM, Limits, PlanBook
from quotas.report import COLUMNS, usage_report


@contextmanager
def _store(data_dir: Path | None, *, create: bool = False) -> Iterator[TenantStore]:
    """The store the gateway uses: the data directory's SQLite file, or TIERGATE_DATABASE_URL's PostgreSQL.

    Only a command that makes something from nothing (`create`: a tenant, an admin key) may start a new data
    directory or its state file. Any other reads, or changes, what is there (a tenant, a key): where there is no
    state file it says so, making none (it made state.db, then answered "no tenant" or "no key")."""
    settings = settings_from(data_dir=data_dir)
    if not create:
        existing_data_dir(settings)
        require(settings.state_db, settings, data_dir, NO_STATE)
    with naming(settings.state_db, settings, data_dir):
        try:
            store = open_tenant_store(settings)
        except TiergateError as exc:
            raise click.ClickException(exc.message) from exc
        try:
            yield store
        except TiergateError as exc:
            raise click.ClickException(exc.message) from exc
        finally:
            store.close()


def _echo_key(public: dict[str, object], plaintext: str) -> None:
    click.echo(f"key id : {public['key_id']}")
    click.echo(f"tenant : {public['tenant'] or '(admin)'}")
    expires = public["expires_at"]
    click.echo(f"expires: {_utc(expires) if isinstance(expires, float) else 'never'}")
    click.echo(f"key    : {plaintext}")
    click.echo("This key is shown once; only its hash is stored.", err=True)


class Duration(click.ParamType):
    """Seconds, or a number with s, m, h or d (`30d`): finite, positive (or zero where allowed) and bounded."""

    name = "duration"

    def __init__(self, maximum: float, *, minimum: float = 0.0, allow_zero: bool = False) -> None:
        self.maximum, self.minimum = maximum, minimum
        self.allow_zero = allow_zero

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):  # a default
            return value
        try:
            return check_seconds(parse_duration(str(value)), maximum=self.maximum, minimum=self.minimum,
                                 allow_zero=self.allow_zero)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@click.group()
def tenants() -> None:
    """Create and list tenants, move one to another plan, bump one's data version."""


@tenants.command("create")
@click.argument("name")
@click.option("--plan", default=None, help="A plan from the plans file [default: its default_plan].")
@click.option("--plans", "plans_file", type=click.Path(path_type=Path), default=None,
              help="Plans file [env TIERGATE_PLANS_FILE; default quotas/plans.yaml].")
@data_dir_option
def tenants_create(name: str, plan: str | None, plans_file: Path | None, data_dir: Path | None) -> None:
    """Create tenant NAME on a plan."""
    settings = settings_from(data_dir=data_dir, plans_file=plans_file)
    try:
        book = load_yaml(settings.plans_file, PlanBook)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    plan = plan or book.default_plan
    if plan not in book.plans:
        raise click.ClickException(f"no plan {plan!r}; plans: {', '.join(book.plans)}")
    with _store(data_dir, create=True) as store:
        tenant = store.create_tenant(name, plan)
    click.echo(f"created tenant {tenant.name} on plan {tenant.plan}")


@tenants.command("list")
@data_dir_option
def tenants_list(data_dir: Path | None) -> None:
    """List tenants: name, plan and creation time (UTC), one a line, tab-separated."""
    with _store(data_dir) as store:
        for t in store.list_tenants():
            click.echo(f"{t.name}\t{t.plan}\t{time.strftime('%Y-%m-%d %H:%M', time.gmtime(t.created_at))}")


@tenants.command("set-plan")
@click.argument("name")
@click.argument("plan")
@click.option("--plans", "plans_file", type=click.Path(path_type=Path), default=None,
              help="Plans file [env TIERGATE_PLANS_FILE; default quotas/plans.yaml].")
@data_dir_option
def tenants_set_plan(name: str, plan: str, plans_file: Path | None, data_dir: Path | None) -> None:
    """Move tenant NAME to PLAN; running gateways (every replica) follow within a second."""
    settings = settings_from(data_dir=data_dir, plans_file=plans_file)
    try:
        book = load_yaml(settings.plans_file, PlanBook)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    if plan not in book.plans:
        raise click.ClickException(f"no plan {plan!r}; plans: {', '.join(book.plans)}")
    with _store(data_dir) as store:
        tenant = store.set_plan(name, plan)
    click.echo(f"tenant {tenant.name} is on plan {tenant.plan}")


@tenants.command("bump-data-version")
@click.argument("name")
@data_dir_option
def tenants_bump(name: str, data_dir: Path | None) -> None:
    """NAME's data changed: cached answers made from the old data are never served again, and are deleted."""
    with _store(data_dir) as store:
        version = store.bump_data_version(name)
    click.echo(f"tenant {name} is at data version {version}")
    click.echo(f"deleted {_drop_cached_answers(settings_from(data_dir=data_dir), name, version)} cached answers "
               "of older data versions")


def _drop_cached_answers(settings: Settings, tenant: str, version: int) -> int:
    """Delete the tenant's cached answers of other data versions from the store the gateway shares (its SQLite
    file or Redis); a running gateway's index follows the store's change log. Returns how many."""
    from cache import CacheStoreError, open_cache_store

    path = settings.data_dir / "cache.sqlite3"
    if not settings.cache_enabled or not (settings.redis_url or path.exists()):
        return 0
    try:
        store = open_cache_store(sqlite_path=path, redis_url=settings.redis_url,
                                 max_entries=settings.cache_max_entries,
                                 max_entries_per_tenant=settings.cache_max_entries_per_tenant,
                                 max_bytes_per_tenant=settings.cache_max_bytes_per_tenant)
        try:
            return len(store.drop_data_versions(tenant, str(version), time.time()))
        finally:
            store.close()
    except CacheStoreError as exc:
        click.echo(f"warning: the old answers stay unreachable until their TTL, deleting them failed: {exc}", err=True)
        return 0


@click.group()
def keys() -> None:
    """Issue, list, revoke and rotate API keys."""


# the option that sets each of a key's Limits
_LIMIT_OPTIONS = {"rpm": "--rpm", "tpm": "--tpm", "max_concurrent": "--max-concurrent",
                  "budget_day_usd": "--budget-day", "budget_month_usd": "--budget-month"}


@keys.command("issue")
@click.option("--tenant", default=None, help="The tenant the key belongs to (this or --admin is required).")
@click.option("--admin", is_flag=True, help="An admin key (no tenant): manages the gateway.")
@click.option("--name", default="", help="A label for the key, shown by `keys list` [default: none].")
@click.option("--ttl", "ttl_s", type=Duration(MAX_TTL_S, minimum=MIN_KEY_TTL_S), default=None,
              help="Time until the key expires: seconds or 90m, 12h, 30d (at most 10 years) [default: never].")
@click.option("--rpm", type=int, default=None,
              help=f"This key's own requests per minute (at most {MAX_RPM:,}) [default: the plan's only].")
@click.option("--tpm", type=int, default=None,
              help=f"This key's own tokens per minute (at most {MAX_TPM:,}) [default: the plan's only].")
@click.option("--max-concurrent", type=int, default=None,
              help=f"This key's own concurrent requests (at most {MAX_CONCURRENT:,}) [default: the plan's only].")
@click.option("--budget-day", type=str, default=None,
              help=f"This key's own daily budget, USD (at most {MAX_BUDGET_USD:,}) [default: the plan's only].")
@click.option("--budget-month", type=str, default=None,
              help=f"This key's own monthly budget, USD (at most {MAX_BUDGET_USD:,}) [default: the plan's only].")
@data_dir_option
def keys_issue(tenant: str | None, admin: bool, name: str, ttl_s: float | None, rpm: int | None, tpm: int | None,
               max_concurrent: int | None, budget_day: str | None, budget_month: str | None,
               data_dir: Path | None) -> None:
    """Issue a key for --tenant, or an --admin key; limits given here apply to this key on top of the plan's."""
    if tenant is not None and admin:
        raise click.UsageError("an admin key cannot belong to a tenant: give --tenant NAME or --admin, not both")
    if tenant is None and not admin:
        raise click.UsageError("give exactly one of --tenant NAME or --admin")
    try:
        limits = Limits(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, budget_day_usd=budget_day,
                        budget_month_usd=budget_month)
    except ValidationError as exc:  # one line naming the option: "Invalid value for '--rpm': ..."
        error = exc.errors()[0]
        raise click.BadParameter(error["msg"].removeprefix("Value error, "),
                                 param_hint=f"'{_LIMIT_OPTIONS[error['loc'][0]]}'") from exc
    if admin and limits != Limits():  # an admin key calls no model: its limits would never apply
        given = [option for field, option in _LIMIT_OPTIONS.items() if getattr(limits, field) is not None]
        raise click.UsageError(f"{', '.join(given)}: an admin key calls no models, so its limits would never apply; "
                               "leave them out, or issue a --tenant key")
    with _store(data_dir, create=admin) as store:
        key, plaintext = store.issue_key(tenant, name=name, roles=(ADMIN,) if admin else (), ttl_s=ttl_s,
                                         limits=None if limits == Limits() else limits)
    _echo_key(key.public(), plaintext)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys [default: every key, admin keys too].")
@data_dir_option
def keys_list(tenant: str | None, data_dir: Path | None) -> None:
    """List keys, never their secrets: one a line, tab-separated: id, tenant, state, name, expiry (UTC, or never)
    and the key that replaced it (`keys rotate`; - for none)."""
    with _store(data_dir) as store:
        if tenant is not None:  # a misspelt name is no tenant, not one without keys
            store.get_tenant(tenant)
        for k in store.list_keys(tenant):
            state = "revoked" if k.revoked_at else ("expired" if not k.active(time.time()) else "active")
            # a rotated key stays active for its grace period: its expiry and successor say it is on its way out
            expires = _utc(k.expires_at) if k.expires_at is not None else "never"
            click.echo(f"{k.key_id}\t{k.tenant or '(admin)'}\t{state}\t{k.name}\t{expires}\t{k.replaced_by or '-'}")


@keys.command("revoke")
@click.argument("key_id")
@data_dir_option
def keys_revoke(key_id: str, data_dir: Path | None) -> None:
    """Revoke KEY_ID (its id, from `keys list`): running gateways refuse it within a second."""
    with _store(data_dir) as store:
        store.revoke_key(key_id)
    click.echo(f"revoked {key_id}")


@keys.command("rotate")
@click.argument("key_id")
@click.option("--grace", "grace_s", type=Duration(MAX_GRACE_S, allow_zero=True), default=0.0, show_default=True,
              help="How long the old key keeps working (never past its own expiry; at most 7 days).")
@click.option("--ttl", "ttl_s", type=Duration(MAX_TTL_S, minimum=MIN_KEY_TTL_S), default=None,
              help="The new key's time to live; it never expires later than the old key would have "
                   "[default: when the old key would have].")
@data_dir_option
def keys_rotate(key_id: str, grace_s: float, ttl_s: float | None, data_dir: Path | None) -> None:
    """Replace KEY_ID by a new key with the same tenant, roles and limits, expiring no later than KEY_ID."""
    with _store(data_dir) as store:
        key, plaintext = store.rotate_key(key_id, grace_s=grace_s, ttl_s=ttl_s)
        old = store.get_key(key_id)
    _echo_key(key.public(), plaintext)
    # when the key it replaces stops working: the operator's deadline for handing the new one out
    if old.revoked_at is not None:
        click.echo(f"old key {old.key_id}: revoked (no --grace)", err=True)
    elif old.expires_at is not None:
        click.echo(f"old key {old.key_id}: works until {_utc(old.expires_at)} (--grace)", err=True)


@click.group(invoke_without_command=True)
@click.option("--tenant", default=None, help="Only this tenant [default: every tenant].")
@data_dir_option
@click.pass_context
def usage(ctx: click.Context, tenant: str | None, data_dir: Path | None) -> None:
    """Usage and cost from the ledger; alone: totals per tenant and tier (see `usage report`)."""
    if ctx.invoked_subcommand is None:
        _print_report(data_dir, tenant=tenant, since=None, until=None, by="tenant,tier", fmt="table")


@usage.command("report")
@click.option("--from", "since", default=None,
              help="First day (YYYY-MM-DD, UTC), included [default: the ledger's first].")
@click.option("--to", "until", default=None,
              help="Last day (YYYY-MM-DD, UTC), included [default: the ledger's last].")
@click.option("--by", default="tenant,tier", show_default=True, help="Comma list of tenant, tier, day, key_id.")
@click.option("--tenant", default=None, help="Only this tenant [default: every tenant].")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="A table to read, or CSV or JSON for a spreadsheet or a script.")
@data_dir_option
def usage_report_cmd(since: str | None, until: str | None, by: str, tenant: str | None, fmt: str,
                     data_dir: Path | None) -> None:
    """Requests, tokens, price, compute cost, margin, per-1K price and cost, savings and refusals."""
    _print_report(data_dir, tenant=tenant, since=since, until=until, by=by, fmt=fmt)


def _print_report(data_dir: Path | None, *, tenant: str | None, since: str | None, until: str | None, by: str,
                  fmt: str) -> None:
    try:
        groups, start, end = parse_by(by), parse_day(since), parse_day(until, end=True)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if start is not None and end is not None and start >= end:  # an empty report, read as no use (end: exclusive)
        raise click.UsageError(f"--from {since} is after --to {until}")
    if tenant is not None:  # a misspelt name is no tenant, not one that used nothing (as the admin API's 404)
        with _store(data_dir) as store:
            store.get_tenant(tenant)
    settings = existing_data_dir(settings_from(data_dir=data_dir))
    require(settings.ledger_db, settings, data_dir, NO_LEDGER)
    with naming(settings.ledger_db, settings, data_dir):
        ledger = open_ledger(settings)
        try:
            rows = usage_report(ledger, by=groups, since=start, until=end, tenant=tenant)
        finally:
            ledger.close()
    if fmt == "csv":
        click.echo(to_csv(rows, header=(*groups, *COLUMNS)), nl=False)
    else:
        click.echo({"table": to_table, "json": to_json}[fmt](rows))
