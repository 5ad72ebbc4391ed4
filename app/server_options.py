"""What `serve`, `worker`, `gateway` and `demo` share: the engine options and the
EngineConfig they build, Settings from options and the environment, logging, and a server
that drains before it stops."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click
import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from app.core.config import Settings, WorkerSettings
from app.core.principal import REGISTRY_ENGINE_PREFIX
from app.main import Mount, begin_drain
from engine.client import EngineClient
from engine.config import SCHEMES, EngineConfig
from engine.models.config import ModelLoadError

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.core_process import ProcessEngine

logger = logging.getLogger("loraplex")

# Where installed packages declare what the service mounts beside its API (the admin UI).
MOUNTS_GROUP = "loraplex.mounts"

_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A failed engine is reported on /health and /ready this long before the socket closes,
# so that probes and load balancers see why the replica goes away.
_FAILURE_GRACE_S = 1.0


def installed_mounts() -> list[Mount]:
    """The Mounts of the MOUNTS_GROUP entry points, by name: what `serve`, `gateway` and
    `demo` pass to create_app (so the app never imports the packages above it)."""
    mounts = []
    for point in sorted(entry_points(group=MOUNTS_GROUP), key=lambda p: p.name):
        mount = point.load()
        if not isinstance(mount, Mount):
            raise TypeError(f"entry point {point.name} ({point.value}) is not an app.main.Mount")
        mounts.append(mount)
    logger.debug("mounted beside the API: %s", ", ".join(m.name for m in mounts) or "nothing")
    return mounts


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


def parse_loras(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, Path]:
    """The `--lora NAME=PATH` callback: names to PEFT adapter directories."""
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


# The engine's options as `serve` and `worker` take them (EngineConfig's fields); `plan`
# takes the sizing ones with its own defaults and help.
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "--model": dict(default="default", show_default=True,
                    help="'default' (bundled SmolLM2-135M-Instruct) or a local HF directory."),
    "--device": dict(default="auto", show_default=True, help="auto | cpu | cuda | cuda:N"),
    "--dtype": dict(default="auto", show_default=True, envvar="LORAPLEX_DTYPE",
                    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                    help="auto: bfloat16 on CUDA and on CPUs with AMX-BF16, or with AVX-512 "
                         "BF16 where a bf16 matmul timed at start beats float32's; float32 "
                         "on other CPUs."),
    "--quantization": dict(default="none", show_default=True, envvar="LORAPLEX_QUANTIZATION",
                           type=click.Choice(SCHEMES),
                           help="Quantization of the base model: its decoder layers int8 "
                                "per output channel or int4 in groups (weight-only, CPU "
                                "and CUDA); w8a8 (int8 weights, and their inputs int8 in "
                                "groups of 64 as each step runs: the fastest on CPUs with "
                                "AVX-512 VNNI; CPU only); fp8 (CUDA, compute capability "
                                "8.9+). On the CPU the embeddings and output projection "
                                "are int8 too; adapters and the KV cache keep --dtype."),
    "--quantization-group-size": dict(
        default=None, type=click.IntRange(min=2),
        help="Inputs per quantization group (default: per channel for int8, 32 for int4)."),
    "--max-loras": dict(default=8, show_default=True, type=click.IntRange(min=1),
                        help="Adapters resident on the device at once."),
    "--max-cpu-loras": dict(default=64, show_default=True, type=click.IntRange(min=1),
                            help="Adapters kept in host memory."),
    "--max-lora-rank": dict(default=64, show_default=True, type=click.IntRange(min=1)),
    "--max-num-seqs": dict(default=64, show_default=True, type=click.IntRange(min=1),
                           help="Sequences per engine step."),
    "--max-num-batched-tokens": dict(default=2048, show_default=True,
                                     type=click.IntRange(min=1), help="Tokens per engine step."),
    "--long-prefill-token-threshold": dict(
        default=None, type=click.IntRange(min=0),
        help="A prompt with more tokens than this left to compute is long: it gets at most "
             "this many tokens of a step until the other requests were served (default: a "
             "quarter of --max-num-batched-tokens; 0: no cap)."),
    "--max-num-partial-prefills": dict(
        default=1, show_default=True, type=click.IntRange(min=1),
        help="Prefills per step that stop short of their prompt's end."),
    "--max-long-partial-prefills": dict(
        default=1, show_default=True, type=click.IntRange(min=1),
        help="Of those, how many may be long prompts."),
    "--kv-cache-tokens": dict(default=None, type=click.IntRange(min=1),
                              help="KV cache capacity in tokens (default: sized from the "
                                   "device)."),
    "--kv-cache-prefault/--no-kv-cache-prefault": dict(
        default=True, show_default=True, envvar="LORAPLEX_KV_CACHE_PREFAULT",
        help="CPU: back the whole KV cache with memory at startup (no page faults in "
             "steps); --no-kv-cache-prefault: as blocks are first written, RSS following "
             "the blocks used."),
    "--gpu-memory-utilization": dict(
        default=0.9, show_default=True, type=click.FloatRange(0, 1, min_open=True),
        help="CUDA: the share of the device's total memory the engine may use (weights, "
             "activations, KV cache); the KV cache gets what a profiled largest step leaves."),
    "--max-model-len": dict(
        default=None, type=click.IntRange(min=1),
        help="Most tokens per sequence, prompt and completion (default: the model's "
             "max_position_embeddings, which it may not exceed)."),
    "--block-size": dict(default=16, show_default=True, type=click.IntRange(min=1)),
    "--enable-prefix-caching/--no-enable-prefix-caching": dict(default=True, show_default=True),
    "--engine-process/--no-engine-process": dict(
        default=False, show_default=True, envvar="LORAPLEX_ENGINE_PROCESS",
        help="Step the engine in a process of its own, apart from the API server's event "
             "loop (default: a thread of the server's process). A crash of the engine "
             "process fails its requests and drains the server instead of killing it."),
    "--fairness": dict(default="vtc", show_default=True, type=click.Choice(["vtc", "fcfs"]),
                       help="Order within a priority: vtc (fair share per tenant) or fcfs "
                            "(arrival order)."),
}

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def engine_option(flag: str, **overrides: Any) -> Decorator:
    """One of ENGINE_OPTIONS as a click option, with some of its settings replaced."""
    return click.option(flag, **{**ENGINE_OPTIONS[flag], **overrides})


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Every engine option, in ENGINE_OPTIONS' order; the command gets them as keyword
    arguments for engine_config()."""
    for flag in reversed(ENGINE_OPTIONS):
        func = engine_option(flag)(func)
    return func


@contextlib.contextmanager
def startup_errors() -> Iterator[None]:
    """What the operator must fix before a server can start (a model directory of a family
    we cannot serve, a value the engine refuses) as a usage error: one line, exit code 2,
    no traceback."""
    try:
        yield
    except (ModelLoadError, ValueError) as exc:
        raise click.UsageError(" ".join(str(exc).split())) from exc


async def start_engine(config: EngineConfig) -> AsyncEngine | ProcessEngine:
    """The engine of `serve`, `worker` and `demo`, its model loaded: in a process of its
    own where `config.engine_process` asks for it, else stepped by a thread of this one."""
    from engine.async_engine import AsyncEngine  # imports torch: only when serving
    from engine.core_process import ProcessEngine

    engine = ProcessEngine(config) if config.engine_process else AsyncEngine(config)
    logger.info("loading model %s", config.model)
    with startup_errors():
        await engine.start()
    return engine


def engine_config(**kwargs: Any) -> EngineConfig:
    try:
        return EngineConfig(**kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


SettingsT = TypeVar("SettingsT", Settings, WorkerSettings)


def _load(kind: type[SettingsT], overrides: dict[str, Any]) -> SettingsT:
    """The environment's settings with the options given (None: not given); a bad value
    is a usage error."""
    try:
        return kind(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        messages = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise click.UsageError(messages) from exc


def load_settings(**overrides: Any) -> Settings:
    """The API server's Settings (serve, gateway, demo)."""
    return _load(Settings, overrides)


def load_worker_settings(**overrides: Any) -> WorkerSettings:
    """An engine worker's WorkerSettings."""
    return _load(WorkerSettings, overrides)


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
