"""`loraplex worker` and `loraplex gateway`: the engine and the API tier as separate
processes, any number of each, finding each other through Redis (REDIS_URL) and sharing
LORAPLEX_WORKER_TOKEN and LORAPLEX_DATA_DIR (the adapter store)."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import click
import redis.asyncio as aioredis

from app.core.config import Settings, WorkerSettings, is_loopback_host
from app.registry.store import adapter_fetcher
from app.server_options import (
    DrainingServer,
    engine_config,
    engine_options,
    installed_mounts,
    load_settings,
    load_worker_settings,
    parse_loras,
    preload_adapters,
    serve_app,
    setup_logging,
    start_engine,
    startup_errors,
)
from engine.config import EngineConfig

logger = logging.getLogger("loraplex")

_MIN_TOKEN_CHARS = 16
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def default_advertise_url(host: str, port: int) -> str:
    """Where gateways reach a worker bound to host:port: the machine's name when bound to
    every address."""
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}"


def _check_token(token: str | None, *, insecure: bool, host: str) -> str | None:
    if token is None:
        if not insecure:
            raise click.UsageError(
                "LORAPLEX_WORKER_TOKEN is not set: the internal API needs a shared secret "
                "(the same on gateways and workers). --insecure-no-token serves without one, "
                "on a loopback address only."
            )
        if not is_loopback_host(host):
            raise click.UsageError(
                f"--insecure-no-token only binds a loopback address (127.0.0.1, ::1, "
                f"localhost), not {host!r}."
            )
        return None
    if len(token) < _MIN_TOKEN_CHARS:
        raise click.UsageError(
            f"LORAPLEX_WORKER_TOKEN must be a random secret of at least {_MIN_TOKEN_CHARS} "
            "characters."
        )
    return token


@click.command()
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", default=None, type=click.IntRange(1, 65535),
              help="Port to bind [default: 8001].")
@click.option("--worker-id", default=None,
              help="Unique among the workers [default: <hostname>-<port>].")
@click.option("--advertise-url", default=None,
              help="Where gateways reach this worker [default: http://<host>:<port>, the "
                   "hostname when bound to every address].")
@click.option("--dedicated-tenant", "dedicated_tenants", multiple=True, metavar="TENANT",
              help="Serve only this tenant, by id or name (repeatable); without it the worker "
                   "is shared.")
@click.option("--insecure-no-token", is_flag=True,
              help="Serve the internal API without LORAPLEX_WORKER_TOKEN (loopback only).")
@click.option("--lora", "loras", multiple=True, callback=parse_loras, metavar="NAME=PATH",
              help="Preload a PEFT adapter directory, visible to every tenant; gateways send "
                   "its requests to the workers that have it (repeatable).")
@engine_options
def worker(
    host: str | None,
    port: int | None,
    worker_id: str | None,
    advertise_url: str | None,
    dedicated_tenants: tuple[str, ...],
    insecure_no_token: bool,
    loras: dict[str, Path],
    **engine: Any,
) -> None:
    """Serve one engine (one GPU or MIG slice) to gateways over the internal API.

    Needs REDIS_URL (heartbeats) and LORAPLEX_WORKER_TOKEN (the gateways' Bearer token);
    reads adapters from the store under LORAPLEX_DATA_DIR, which gateways and workers
    share, and `--lora` adapters from their own directories (announced in the heartbeat:
    gateways list them and route their requests here). SIGTERM: leaves rotation at once,
    finishes in-flight requests, exits 0.
    """
    settings = load_worker_settings(host=host, port=port)
    if not settings.redis_url:
        raise click.UsageError(
            "loraplex worker needs REDIS_URL: gateways find workers by their heartbeats there."
        )
    token = _check_token(settings.worker_token, insecure=insecure_no_token, host=settings.host)
    config = engine_config(**engine, data_dir=settings.data_dir)
    setup_logging()
    asyncio.run(
        serve_worker(
            config,
            settings,
            token=token,
            worker_id=worker_id or f"{socket.gethostname()}-{settings.port}",
            advertise_url=advertise_url or default_advertise_url(settings.host, settings.port),
            dedicated_tenants=dedicated_tenants,
            loras=loras,
        )
    )


async def serve_worker(
    config: EngineConfig,
    settings: WorkerSettings,
    *,
    token: str | None,
    worker_id: str,
    advertise_url: str,
    dedicated_tenants: tuple[str, ...] = (),
    loras: dict[str, Path] | None = None,
) -> None:
    """Load the engine and its `--lora` adapters, serve the internal API, beat until
    SIGTERM/SIGINT, drain."""
    from app.metrics import Metrics
    from engine.remote.heartbeat import HeartbeatPublisher, make_identity
    from engine.remote.worker_app import begin_drain, create_worker_app, get_state_of

    assert settings.redis_url is not None
    engine = await start_engine(config)
    try:
        refused = await preload_adapters(engine, loras or {})
    except BaseException:
        await engine.shutdown()
        raise
    redis = aioredis.Redis.from_url(settings.redis_url, socket_timeout=5.0)
    identity = make_identity(
        worker_id=worker_id,
        url=advertise_url,
        device=engine.device,
        mig_profile=settings.mig_profile,
        dedicated_tenants=dedicated_tenants,
        preloaded_adapters=tuple(n for n in loras or {} if n not in refused),
    )
    app = create_worker_app(
        engine, token=token, data_dir=settings.data_dir, render_metrics=Metrics(engine).render,
        fetch_adapter=adapter_fetcher(settings, engine),
    )
    publisher = HeartbeatPublisher(
        redis,
        identity,
        engine,
        interval_s=settings.heartbeat_interval_s,
        ttl_s=settings.heartbeat_ttl_s,
        is_draining=lambda: get_state_of(app).draining,
    )

    def on_exit() -> None:
        # NOTE: out of rotation first (the heartbeat goes), then the socket closes.
        begin_drain(app)
        publisher.withdraw_soon()

    # NOTE: a failed engine drains like SIGTERM: out of rotation at once, then exit 1.
    server = DrainingServer(app, settings, on_exit=on_exit, engine_failure=engine.failure)
    try:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            # Announced only once the socket listens: gateways never find a closed port.
            await publisher.start()
            logger.info(
                "worker %s serving %s on %s at %s%s",
                identity.worker_id, engine.model_id, identity.device, identity.url,
                f", dedicated to {', '.join(identity.dedicated_tenants)}"
                if identity.dedicated_tenants else "",
            )
        await serving
    finally:
        await publisher.stop()
        await engine.shutdown()
        await redis.aclose()
    server.raise_if_engine_failed()


@click.command()
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Port to bind [default: 8000].")
@click.option("--no-auth", is_flag=True, help="Serve without API keys (loopback addresses only).")
@click.option("--model", default="default", show_default=True,
              help="The workers' model: 'default' or a local HF directory (only its tokenizer "
                   "and config are read).")
def gateway(host: str | None, port: int | None, no_auth: bool, model: str) -> None:
    """Serve the OpenAI-compatible and admin APIs, running requests on workers.

    Stateless: run any number behind a load balancer. Needs REDIS_URL (worker heartbeats,
    shared quotas), LORAPLEX_WORKER_TOKEN, DATABASE_URL shared by all gateways, and
    LORAPLEX_DATA_DIR shared with the workers (the adapter store).
    """
    bind = host or load_settings().host
    if no_auth and not is_loopback_host(bind):
        raise click.UsageError(
            f"--no-auth serves without API keys and only binds a loopback address "
            f"(127.0.0.1, ::1, localhost), not {bind!r}."
        )
    settings = load_settings(host=host, port=port, no_auth=no_auth)
    if not settings.redis_url:
        raise click.UsageError(
            "loraplex gateway needs REDIS_URL: it finds workers by their heartbeats there."
        )
    setup_logging()
    if not settings.worker_token:
        logger.warning(
            "LORAPLEX_WORKER_TOKEN is not set: only workers started with --insecure-no-token "
            "will take requests from this gateway"
        )
    if not no_auth and not settings.admin_key:
        logger.warning(
            "LORAPLEX_ADMIN_KEY is not set: only admin keys already in the database can "
            "manage tenants"
        )
    asyncio.run(serve_gateway(model, settings))


async def serve_gateway(model: str, settings: Settings) -> None:
    """The API app around a RemoteEngine, until SIGTERM/SIGINT."""
    from app.main import create_app
    from engine.remote.client import RemoteEngine
    from engine.remote.tokenizer import LocalTokenizer

    assert settings.redis_url is not None
    with startup_errors():
        tokenizer = await asyncio.to_thread(LocalTokenizer, model, settings.data_dir)
    engine = RemoteEngine(
        redis=aioredis.Redis.from_url(settings.redis_url, socket_timeout=5.0),
        tokenizer=tokenizer,
        model_id=tokenizer.model_id,
        max_model_len=tokenizer.model_config.max_model_len,
        max_adapter_bytes=tokenizer.default_max_adapter_bytes(),
        data_dir=settings.data_dir,
        token=settings.worker_token,
        refresh_interval_s=settings.refresh_interval_s,
        max_attempts=settings.worker_attempts,
    )
    await engine.start()
    try:
        app = create_app(engine, settings, mounts=installed_mounts())
    except BaseException:
        await engine.shutdown()
        raise
    await serve_app(app, engine, settings)
