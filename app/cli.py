"""The `loraplex` command line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import click
import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from app.api.serving import REGISTRY_ENGINE_PREFIX
from app.core.config import Settings, is_loopback_host
from app.main import begin_drain, create_app
from engine.client import EngineClient
from engine.config import EngineConfig

logger = logging.getLogger("loraplex")

_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A failed engine is reported on /health and /ready this long before the socket closes,
# so that probes and load balancers see why the replica goes away.
_FAILURE_GRACE_S = 1.0


class ListenSettings(Protocol):
    """What a server needs of Settings or WorkerSettings."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def drain_timeout_s(self) -> float: ...


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT the app starts draining before the socket closes.

    uvicorn then stops accepting, waits up to `timeout_graceful_shutdown` for in-flight
    requests and cancels the rest; a cancelled request closes its engine stream, which
    aborts it in the engine.
    """

    def __init__(
        self,
        app: FastAPI,
        settings: ListenSettings,
        *,
        on_exit: Callable[[], None] | None = None,
        engine_failure: Callable[[], str | None] | None = None,
    ) -> None:
        """Serve `app` on settings.host:port, with settings.drain_timeout_s to drain.
        on_exit: what to do first on SIGTERM/SIGINT (default: the API app's drain).
        engine_failure: polled while serving; once it names a reason the server drains
        and stops as on SIGTERM, and `failure` holds the reason."""
        super().__init__(uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]
            log_level="info",
        ))
        self._app = app
        self._on_exit = on_exit
        self._engine_failure = engine_failure
        self.failure: str | None = None
        self._failed_at = 0.0

    def _begin_exit(self) -> None:
        if self._on_exit is not None:
            self._on_exit()
        else:
            begin_drain(self._app)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._begin_exit()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.failure is None and self._engine_failure is not None:
            reason = self._engine_failure()
            if reason is not None:
                logger.critical("the engine failed (%s): draining, then exiting", reason)
                self.failure, self._failed_at = reason, time.monotonic()
                self._begin_exit()
        if self.failure is not None and time.monotonic() - self._failed_at >= _FAILURE_GRACE_S:
            self.should_exit = True
        return await super().on_tick(counter)

    def raise_if_engine_failed(self) -> None:
        """After serving: EngineFailed (exit 1) if it stopped because the engine failed."""
        if self.failure is not None:
            raise EngineFailed(self.failure)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn re-raises a caught signal once it has shut down, which would kill
        # the process before the engine shuts down, with a non-zero status. SIGTERM is the
        # normal way to stop a replica: it ends in a clean exit 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _EXIT_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class EngineFailed(click.ClickException):
    """The engine failed for good: the process exits 1 so that its supervisor restarts it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the engine failed: {reason}")


async def serve_app(app: FastAPI, engine: EngineClient, settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT, drain, then shut the engine down; raise EngineFailed
    after draining if the engine failed."""
    server = DrainingServer(app, settings, engine_failure=engine.failure)
    try:
        await server.serve()
    finally:
        await engine.shutdown()
    server.raise_if_engine_failed()


async def serve_engine(
    config: EngineConfig,
    settings: Settings,
    *,
    on_ready: Callable[[EngineClient, Settings], None] | None = None,
) -> None:
    """Load the engine in this process and serve it."""
    from engine.async_engine import AsyncEngine  # imports torch: only when serving

    engine = AsyncEngine(config)
    logger.info("loading model %s", config.model)
    await engine.start()
    try:
        await preload_adapters(engine, settings.preload_loras)
        app = create_app(engine, settings)
        if on_ready is not None:
            on_ready(engine, settings)
    except BaseException:
        await engine.shutdown()
        raise
    await serve_app(app, engine, settings)


async def preload_adapters(engine: EngineClient, loras: dict[str, Path]) -> list[str]:
    """Serve each `--lora NAME=PATH`; a refused adapter is logged with its reason and the
    others are served anyway. Returns the names refused."""
    refused: list[str] = []
    for name, path in loras.items():
        try:
            info = await engine.add_adapter(name, str(path))
        except ValueError as exc:
            logger.error("adapter %s (%s) refused: %s", name, path, exc)
            refused.append(name)
            continue
        logger.info(
            "adapter %s: rank %d, targets %s, from %s",
            name,
            info.rank,
            ",".join(info.target_modules),
            path,
        )
    return refused


def _parse_loras(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, Path]:
    loras: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=PATH, got {value!r}", ctx, param)
        if name in loras:
            raise click.BadParameter(f"adapter name {name!r} given twice", ctx, param)
        if name.startswith(REGISTRY_ENGINE_PREFIX):
            raise click.BadParameter(
                f"adapter names starting with {REGISTRY_ENGINE_PREFIX!r} are reserved for "
                "the adapter registry", ctx, param
            )
        directory = Path(path)
        if not (directory / "adapter_config.json").is_file():
            raise click.BadParameter(
                f"{path!r} is not a PEFT adapter directory (no adapter_config.json)", ctx, param
            )
        loras[name] = directory
    return loras


def _engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--model", default="default", show_default=True,
                     help="'default' (bundled SmolLM2-135M-Instruct) or a local HF directory."),
        click.option("--device", default="auto", show_default=True,
                     help="auto | cpu | cuda | cuda:N"),
        click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "float32", "bfloat16", "float16"])),
        click.option("--max-loras", default=8, show_default=True, type=click.IntRange(min=1),
                     help="Adapters resident on the device at once."),
        click.option("--max-cpu-loras", default=64, show_default=True,
                     type=click.IntRange(min=1), help="Adapters kept in host memory."),
        click.option("--max-lora-rank", default=64, show_default=True,
                     type=click.IntRange(min=1)),
        click.option("--max-num-seqs", default=64, show_default=True,
                     type=click.IntRange(min=1), help="Sequences per engine step."),
        click.option("--max-num-batched-tokens", default=2048, show_default=True,
                     type=click.IntRange(min=1), help="Tokens per engine step."),
        click.option("--kv-cache-tokens", default=None, type=click.IntRange(min=1),
                     help="KV cache capacity in tokens (default: sized from the device)."),
        click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1)),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
                     show_default=True),
        click.option("--fairness", default="vtc", show_default=True,
                     type=click.Choice(["vtc", "fcfs"]),
                     help="Order within a priority: vtc (fair share per tenant) or fcfs "
                          "(arrival order)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _engine_config(**kwargs: Any) -> EngineConfig:
    try:
        return EngineConfig(**kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        messages = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise click.UsageError(messages) from exc


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@click.group()
@click.version_option(package_name="loraplex")
def main() -> None:
    """loraplex: one base model, many LoRA adapters, an OpenAI-compatible API."""


@main.command()
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Port to bind [default: 8000].")
@click.option("--lora", "loras", multiple=True, callback=_parse_loras, metavar="NAME=PATH",
              help="Preload a PEFT adapter directory, visible to every tenant (repeatable).")
@click.option("--no-auth", is_flag=True, help="Serve without API keys (loopback addresses only).")
@_engine_options
def serve(
    host: str | None, port: int | None, loras: dict[str, Path], no_auth: bool, **engine: Any
) -> None:
    """Serve the OpenAI-compatible and admin APIs with the engine in this process.

    Callers need API keys: LORAPLEX_ADMIN_KEY is the bootstrap admin key, which creates
    tenants and their keys through /admin. --no-auth serves without keys (loopback only).
    """
    bind = host or _settings().host
    if no_auth and not is_loopback_host(bind):
        raise click.UsageError(
            f"--no-auth serves without API keys and only binds a loopback address "
            f"(127.0.0.1, ::1, localhost), not {bind!r}."
        )
    settings = _settings(host=host, port=port, no_auth=no_auth, preload_loras=loras)
    config = _engine_config(**engine)
    _setup_logging()
    if not no_auth and not settings.admin_key:
        logger.warning(
            "LORAPLEX_ADMIN_KEY is not set: only admin keys already in the database can "
            "manage tenants"
        )
    asyncio.run(serve_engine(config, settings))


@main.command()
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Port to bind [default: 8000].")
def demo(port: int | None) -> None:
    """Serve the bundled model on 127.0.0.1 with demo tenants, keys and small LoRA
    adapters trained on it (once, then cached), and print what to try."""
    from app.demo.run import run_demo

    _setup_logging()
    run_demo(_settings(host="127.0.0.1", port=port))



@main.group()
def db() -> None:
    """The service database (DATABASE_URL; default: SQLite under LORAPLEX_DATA_DIR)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Apply the migrations up to REVISION (run once per release, before the servers)."""
    from app.db import upgrade

    settings = _settings()
    _setup_logging()
    upgrade(settings.resolved_database_url, revision)
    click.echo(f"database upgraded to {revision}")


@db.command("downgrade")
@click.argument("revision")
def db_downgrade(revision: str) -> None:
    """Revert the migrations down to REVISION ("base": an empty database)."""
    from app.db import downgrade

    settings = _settings()
    _setup_logging()
    downgrade(settings.resolved_database_url, revision)
    click.echo(f"database downgraded to {revision}")


def _register_subcommands() -> None:
    from app.admin_cli import admin
    from app.plan_cli import plan
    from app.scaleout_cli import gateway, worker
    from bench.cli import bench

    main.add_command(bench)
    main.add_command(plan)
    main.add_command(worker)
    main.add_command(gateway)
    main.add_command(admin)


if __name__ == "__main__":
    # NOTE: run as `python -m app.cli`, this file is __main__, a second copy of app.cli;
    # the subcommand modules import app.cli itself, so run the commands from there.
    from app.cli import main as registered_main

    registered_main()
else:
    _register_subcommands()
