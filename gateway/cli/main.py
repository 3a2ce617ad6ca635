"""`tiergate`: serve the gateway, run an engine, prepare models, manage tenants and keys, read usage."""

from __future__ import annotations

import click

from gateway.cli.admin_commands import keys, tenants, usage
from gateway.cli.degrade_commands import degrade
from gateway.cli.engine_commands import engine, models
from gateway.cli.errors import TiergateGroup
from gateway.cli.rollout_commands import rollout
from gateway.cli.router_commands import router
from gateway.cli.serve import serve


@click.group(cls=TiergateGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """Tiergate: a cost-aware, multi-tenant, OpenAI-compatible gateway for language models.

    State (tenants, keys, the ledger) and prepared models live in one data directory
    (--data-dir or TIERGATE_DATA_DIR, default ~/.local/share/tiergate). Admin commands act on the same
    state as a running gateway and take effect at once.
    """


cli.add_command(serve)
cli.add_command(models)
cli.add_command(engine)
cli.add_command(tenants)
cli.add_command(keys)
cli.add_command(usage)
cli.add_command(degrade)
cli.add_command(router)
cli.add_command(rollout)

if __name__ == "__main__":
    cli()
