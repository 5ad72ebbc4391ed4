"""The `loraplex` command line."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from app.admin_cli import admin
from app.core.config import Settings, is_loopback_host
from app.main import create_app
from app.plan_cli import plan
from app.scaleout_cli import gateway, worker
from app.server_options import (
    engine_config,
    engine_option,
    engine_options,
    installed_mounts,
    load_settings,
    parse_loras,
    preload_adapters,
    serve_app,
    setup_logging,
    start_engine,
)
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.runtime.host_memory import share_one_heap

logger = logging.getLogger("loraplex")

# Commands loaded by module name when they are used. NOTE: the benchmarks drive the app
# from outside (bench imports app, never the reverse), so `loraplex bench` reaches them
# only by name; `loraplex-bench` runs the same group on its own.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {"bench": ("bench.cli", "bench")}


class LoraplexGroup(click.Group):
    """The top-level group: its own commands plus LAZY_COMMANDS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in LAZY_COMMANDS:
            module_name, attribute = LAZY_COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module_name), attribute)
            assert isinstance(command, click.Command), f"{module_name}.{attribute}"
        return command


async def serve_engine(
    config: EngineConfig,
    settings: Settings,
    *,
    on_ready: Callable[[EngineClient, Settings], None] | None = None,
) -> None:
    """Load the engine in this process and serve it."""
    engine = await start_engine(config)
    try:
        await preload_adapters(engine, settings.preload_loras)
        app = create_app(engine, settings, mounts=installed_mounts())
        if on_ready is not None:
            on_ready(engine, settings)
    except BaseException:
        await engine.shutdown()
        raise
    await serve_app(app, engine, settings)


@click.group(cls=LoraplexGroup)
@click.version_option(package_name="loraplex")
def main() -> None:
    """loraplex: one base model, many LoRA adapters, an OpenAI-compatible API."""
    # As early as the command can: threads started from here on allocate from the main
    # heap (engine/runtime/host_memory.py). AsyncEngine asks again, for programs that start it
    # without this command.
    share_one_heap()


@main.command()
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Port to bind [default: 8000].")
@click.option("--lora", "loras", multiple=True, callback=parse_loras, metavar="NAME=PATH",
              help="Preload a PEFT adapter directory, visible to every tenant (repeatable).")
@click.option("--no-auth", is_flag=True, help="Serve without API keys (loopback addresses only).")
@engine_options
def serve(
    host: str | None, port: int | None, loras: dict[str, Path], no_auth: bool, **engine: Any
) -> None:
    """Serve the OpenAI-compatible and admin APIs with the engine in this process.

    Callers need API keys: LORAPLEX_ADMIN_KEY is the bootstrap admin key, which creates
    tenants and their keys through /admin. --no-auth serves without keys (loopback only).
    """
    bind = host or load_settings().host
    if no_auth and not is_loopback_host(bind):
        raise click.UsageError(
            f"--no-auth serves without API keys and only binds a loopback address "
            f"(127.0.0.1, ::1, localhost), not {bind!r}."
        )
    settings = load_settings(host=host, port=port, no_auth=no_auth, preload_loras=loras)
    config = engine_config(**engine)
    setup_logging()
    if not no_auth and not settings.admin_key:
        logger.warning(
            "LORAPLEX_ADMIN_KEY is not set: only admin keys already in the database can "
            "manage tenants"
        )
    asyncio.run(serve_engine(config, settings))


@main.command()
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Port to bind [default: 8000].")
@engine_option("--quantization")
@engine_option("--quantization-group-size")
def demo(port: int | None, quantization: str, quantization_group_size: int | None) -> None:
    """Serve the bundled model on 127.0.0.1 with demo tenants, keys and small LoRA
    adapters trained on it (once, then cached), and print what to try."""
    from app.demo.run import run_demo

    setup_logging()
    settings = load_settings(host="127.0.0.1", port=port)
    run_demo(settings, engine_config(data_dir=settings.data_dir, quantization=quantization,
                                     quantization_group_size=quantization_group_size))



@main.group()
def db() -> None:
    """The service database (DATABASE_URL; default: SQLite under LORAPLEX_DATA_DIR)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Apply the migrations up to REVISION (run once per release, before the servers)."""
    from app.db import upgrade

    settings = load_settings()
    setup_logging()
    upgrade(settings.resolved_database_url, revision)
    click.echo(f"database upgraded to {revision}")


@db.command("downgrade")
@click.argument("revision")
def db_downgrade(revision: str) -> None:
    """Revert the migrations down to REVISION ("base": an empty database)."""
    from app.db import downgrade

    settings = load_settings()
    setup_logging()
    downgrade(settings.resolved_database_url, revision)
    click.echo(f"database downgraded to {revision}")


main.add_command(plan)
main.add_command(worker)
main.add_command(gateway)
main.add_command(admin)


if __name__ == "__main__":
    main()
