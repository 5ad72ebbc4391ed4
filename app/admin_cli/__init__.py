"""`loraplex admin`: onboarding and operations over a running server's admin API."""

from __future__ import annotations

import click

from app.admin_cli.client import DEFAULT_URL, AdminContext
from app.admin_cli.commands import adapters, invoices, keys, tenants, usage


@click.group()
@click.option("--url", envvar="LORAPLEX_URL", default=DEFAULT_URL, show_default=True,
              help="The server (env LORAPLEX_URL).")
@click.option("--admin-key", envvar="LORAPLEX_ADMIN_KEY", default=None,
              help="An admin key (env LORAPLEX_ADMIN_KEY); not needed with `serve --no-auth`.")
@click.pass_context
def admin(ctx: click.Context, url: str, admin_key: str | None) -> None:
    """Tenants, keys, adapters (push a PEFT directory), usage and invoices.

    Exit status: 0 done, 1 adapter validation failed, 2 bad usage or local input,
    3 server unreachable or the request refused (the server's message is printed).
    """
    ctx.obj = AdminContext(url=url, admin_key=admin_key)


for _command in (tenants, keys, adapters, usage, invoices):
    admin.add_command(_command)
