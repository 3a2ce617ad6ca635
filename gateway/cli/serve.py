"""`tiergate serve`: prepare models, bootstrap keys, start the gateway and its local engines."""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx
from litestar import Litestar

from assets.model_source import BUILTIN_MODELS, is_prepared
from gateway.app import create_app, load_config
from gateway.bootstrap import banner, ensure_bootstrap
from gateway.cli.first_use import start_background_builds
from gateway.cli.options import data_dir_option, settings_from
from gateway.config_files import ConfigFileError
from gateway.pipeline.prompt import tokenizer_source
from gateway.redis_eviction import RedisEvicts, check_redis_eviction
from gateway.routes.health import readiness
from gateway.settings import MAX_WORKERS, Settings
from gateway.stores import DatabaseUnreachable, open_tenant_store
from gateway.tenant_plans import check_tenant_plans
from gateway.workers import require_shared_quotas, run_workers


@click.command()
@click.option("--host", default=None, help="Bind address [env TIERGATE_HOST; default 127.0.0.1].")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port [env TIERGATE_PORT; default 8080].")
@click.option("--tiers", "tiers_file", type=click.Path(path_type=Path), default=None,
              help="Tier catalogue [env TIERGATE_TIERS_FILE; default tiers/tiers.yaml].")
@click.option("--plans", "plans_file", type=click.Path(path_type=Path), default=None,
              help="Plans [env TIERGATE_PLANS_FILE; default quotas/plans.yaml].")
@click.option("--ladder", "ladder_file", type=click.Path(path_type=Path), default=None,
              help="Degradation ladder [env TIERGATE_LADDER_FILE; default degrade_ladder.yaml].")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="Prepared models [env TIERGATE_MODELS_DIR; default <data dir>/models].")
@click.option("--workers", type=click.IntRange(1, MAX_WORKERS), default=None,
              help="Gateway processes on the one port; more than one needs TIERGATE_REDIS_URL, where quotas are "
                   "counted for all [env TIERGATE_WORKERS; default 1].")
@data_dir_option
def serve(host: str | None, port: int | None, tiers_file: Path | None, plans_file: Path | None,
          ladder_file: Path | None, models_dir: Path | None, workers: int | None, data_dir: Path | None) -> None:
    """Serve the OpenAI-compatible gateway with its local tier engines.

    On first use this downloads and prepares the default model (progress bars), creates an admin key
    and a `demo` tenant key, and prints an example request once every tier that can run is ready.
    While serving, it distils the `small` tier's student (10 minutes by default, once; the tier is reported
    as preparing and routed around until then) and then builds the router's difficulty model
    (TIERGATE_BUILD_MISSING_MODELS=0 turns both off).

    With --workers N, N gateway processes share the port and this one supervises the engines and builds
    (gateway/workers.py).
    """
    settings = settings_from(host=host, port=port, tiers_file=tiers_file, plans_file=plans_file,
                             ladder_file=ladder_file, models_dir=models_dir, workers=workers, data_dir=data_dir)
    require_shared_quotas(settings)
    _check_listen(settings.host, settings.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe is noise
    try:
        catalogue, plans = load_config(settings)
        check_redis_eviction(settings)  # once, for every worker, before models are prepared
    except (ConfigFileError, RedisEvicts) as exc:
        raise click.ClickException(str(exc)) from exc
    versions = [v for t in catalogue.tiers.values() for v in (t.variants.values() or [t])]  # every version runs
    sources = {v.model for v in versions if v.backend == "local"}
    sources |= {tokenizer_source(v) for v in versions}
    for source in sorted(sources):
        if source in BUILTIN_MODELS and not is_prepared(source, settings.resolved_models_dir):
            # a child process, so the gateway itself never imports torch; it says what went wrong itself
            try:
                subprocess.run([sys.executable, "-m", "gateway.cli.main", "models", "fetch", "--model", source,
                                "--models-dir", str(settings.resolved_models_dir)], check=True)
            except subprocess.CalledProcessError as exc:
                raise click.ClickException(f"preparing model {source} failed (see above)") from exc
    try:
        store = open_tenant_store(settings, wait_s=settings.database_start_wait_s)
    except DatabaseUnreachable as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        keys = ensure_bootstrap(store, plans, settings.data_dir)
        check_tenant_plans(store, plans, settings.plans_file)  # before any worker starts
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    if settings.workers > 1:
        start_background_builds(settings, catalogue)
        run_workers(settings, catalogue, keys)
        return
    try:
        app = create_app(settings, check_redis=False)
    except DatabaseUnreachable as exc:  # gone since the store above was opened
        raise click.ClickException(str(exc)) from exc
    threading.Thread(target=_announce_when_ready, args=(app, settings, keys), daemon=True).start()
    start_background_builds(settings, catalogue)

    import uvicorn

    from gateway import http_limits

    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=5,
                http=http_limits.for_settings(settings))


def _check_listen(host: str, port: int) -> None:
    """Refuse a host and port that cannot be listened on (one taken by a gateway already running, most often) before
    anything is prepared: uvicorn found it out only once engines had started, the embedder loaded and first-use
    builds begun, and said so in a log line among theirs."""
    try:
        # the family and address as uvicorn's own bind takes them (IPv6 only for a host with a colon)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no refusal
            probe.bind((host, port))
    except OSError as exc:
        taken = " (another process listens there: a gateway already running?)" if \
            getattr(exc, "errno", None) == errno.EADDRINUSE else ""
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}{taken}; give another "
                                   "--port or --host (TIERGATE_PORT, TIERGATE_HOST)") from exc


def _announce_when_ready(app: Litestar, settings: Settings, keys: dict[str, str] | None) -> None:
    """Print the banner once the port answers and every tier that can run is ready (read in process: the
    public /health says only ready or not)."""
    url = f"http://{settings.host}:{settings.port}/health"
    last = ""
    # one client for every poll: a bare httpx.get builds a new SSL context each second, a slice of start-up's CPU
    with httpx.Client(timeout=2.0) as client:
        while True:
            time.sleep(1.0)
            services = getattr(app.state, "services", None)
            try:
                client.get(url)
            except httpx.HTTPError:
                continue
            if services is None:
                continue
            ready, details = readiness(services.fleet, services.ledger, services.redis_eviction)
            if ready:
                for name, why in details["not_ready"].items():
                    click.echo(f"note: tier {name} is not available: {why}", err=True)
                click.echo(banner(keys, host=settings.host, port=settings.port, data_dir=settings.data_dir))
                return
            # Redis's policy changed since start-up's check (redis_eviction_watch.py): its reason, not a tier's
            redis_reason = details.get("redis", {}).get("not_ready")
            waiting = f"not ready: {redis_reason}" if redis_reason else \
                f"waiting for tiers to load: {', '.join(sorted(details['not_ready']))}"
            if waiting != last:
                click.echo(waiting, err=True)
                last = waiting
