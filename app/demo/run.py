"""`loraplex demo`: train (or reuse) the demo adapters, serve the bundled model with auth
on 127.0.0.1, set up the demo tenants and adapters in it, and print what to try."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click
import uvicorn

from app.api.state import AppState
from app.core.config import Settings
from app.demo import printout
from app.demo.cache import TrainedAdapter, ensure_trained
from app.demo.catalog import DEMO_ADAPTERS
from app.demo.seed import KEYS_FILE, AdminKey, DemoError, ensure_admin_key, seed_demo
from app.demo.train import TrainingError
from app.main import create_app
from app.server_options import DrainingServer, installed_mounts, start_engine
from engine.config import EngineConfig
from engine.models.loader import resolve_model_dir
from engine.runtime.threads import on_passing_thread

logger = logging.getLogger("loraplex.demo")


def demo_dir(settings: Settings) -> Path:
    return settings.data_dir / "demo"


def prepare_adapters(
    settings: Settings, echo: Callable[[str], None] = click.echo
) -> list[TrainedAdapter]:
    """The bundled model converted (once) and the demo adapters trained on it (once)."""
    base_dir = resolve_model_dir("default", settings.data_dir)
    # NOTE: on a thread that ends with the training, so that its OpenMP team goes too
    # and the engine's step thread is left the only one (engine/runtime/threads.py).
    trained = on_passing_thread(
        lambda: ensure_trained(DEMO_ADAPTERS, base_dir, demo_dir(settings) / "adapters",
                               echo=echo),
        name="loraplex-demo-train",
    )
    gc.collect()  # the training model's memory goes back before the engine loads
    return trained


def run_demo(settings: Settings, config: EngineConfig | None = None) -> None:
    """Blocks until SIGINT/SIGTERM. settings: host, port and data dir (auth is forced on)."""
    started = time.monotonic()
    admin = ensure_admin_key(demo_dir(settings), settings.admin_key)
    settings = settings.model_copy(update={"admin_key": admin.key, "no_auth": False})
    click.echo(f"loraplex demo: data in {settings.data_dir.resolve()}")
    config = config or EngineConfig(data_dir=settings.data_dir)
    try:
        trained = prepare_adapters(settings)
        asyncio.run(_serve(config, settings, admin, trained, started))
    except (DemoError, TrainingError) as e:
        raise click.ClickException(str(e)) from None


async def _serve(
    config: EngineConfig,
    settings: Settings,
    admin: AdminKey,
    trained: Sequence[TrainedAdapter],
    started: float,
) -> None:
    engine = await start_engine(config)
    try:
        app = create_app(engine, settings, mounts=installed_mounts())
        server = DrainingServer(app, settings, engine_failure=engine.failure)
        serving = asyncio.create_task(server.serve())
        # NOTE: set up inside the running server: uploads go through its registry, which
        # validates them in its engine, exactly as POST /admin/adapters would.
        while not server.started:
            if serving.done():
                await serving  # it could not start (e.g. the port is taken)
                return
            await asyncio.sleep(0.05)
        state = app.state.loraplex
        assert isinstance(state, AppState)
        try:
            setup = await seed_demo(state, trained)
        except BaseException:
            server.should_exit = True
            await serving
            raise
        if not server.should_exit:
            click.echo(printout.render(
                base=f"http://{settings.host}:{server_port(server, settings)}",
                model_id=engine.model_id,
                admin=admin,
                setup=setup,
                adapters=list(trained),
                keys_file=str(demo_dir(settings) / KEYS_FILE),
            ))
            click.echo(f"  (ready {time.monotonic() - started:.0f} s after start)\n")
        await serving
    finally:
        await engine.shutdown()
    server.raise_if_engine_failed()


def server_port(server: uvicorn.Server, settings: Settings) -> int:
    """The bound port (differs from the setting with --port 0)."""
    for s in server.servers:
        for sock in s.sockets:
            return int(sock.getsockname()[1])
    return settings.port
