"""The server `loraplex bench serve` loads: one at `--base-url`, or a `loraplex serve`
it starts with random rank-16 PEFT adapters (and whose pid it keeps, for its RSS)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.harness.server import LaunchedServer, loraplex_serve, model_name
from bench.lora import make_adapters
from bench.serve.client import Target
from bench.serve.options import ServeOptions
from engine.config import default_data_dir
from engine.models.loader import ModelLoadError, load_model_config, resolve_model_dir

ADAPTER_RANK = 16
ADAPTER_TARGETS = "attention"


@contextlib.contextmanager
def open_target(opts: ServeOptions) -> Iterator[Target]:
    """The server at `--base-url`, or one started here for as long as the block runs."""
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    if opts.base_url is not None:
        base_url = opts.base_url.rstrip("/")
        yield Target(base_url, opts.model or model_name(base_url, headers), opts.adapter_models,
                     headers, opts.ignore_eos,
                     vocab_size=opts.vocab_size or _local_vocab_size(opts.model))
        return
    model = opts.model or "default"
    model_dir = resolve_model_dir(model, default_data_dir())
    config = load_model_config(model_dir)
    # The bundled model's adapters are the other LoRA benchmarks' too; another model's
    # go to a folder of their own, since their shapes differ.
    root = opts.adapters_root if model == "default" else opts.adapters_root / model_dir.name
    adapters = make_adapters(root, config, opts.num_adapters, rank=ADAPTER_RANK,
                             targets=ADAPTER_TARGETS)
    lora_flags = [flag for name, path in adapters.items() for flag in ("--lora", f"{name}={path}")]
    with started_server(["--model", model, *lora_flags, *opts.serve_args]) as server:
        yield Target(server.base_url, model_name(server.base_url), {}, headers, opts.ignore_eos,
                     server.pid, opts.vocab_size or config.vocab_size)


@contextlib.contextmanager
def started_server(serve_args: list[str], *, timeout_s: float = 600.0
                   ) -> Iterator[LaunchedServer]:
    """A `loraplex serve --no-auth` started with `serve_args`, stopped at the end. Its log
    (a line per request) goes to a file, quoted if the server fails to start."""
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-serve-") as tmp, \
            loraplex_serve(serve_args, log_path=Path(tmp) / "serve.log",
                           timeout_s=timeout_s) as server:
        yield server


def _local_vocab_size(model: str | None) -> int | None:
    """The vocabulary of `model` when it names a local model directory (or the bundled
    "default"); None otherwise."""
    if model is None:
        return None
    try:
        return load_model_config(resolve_model_dir(model, default_data_dir())).vocab_size
    except (ModelLoadError, OSError, ValueError):
        return None
