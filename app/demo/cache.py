"""Trained demo adapters, cached under <data dir>/demo/adapters/<name>-<key>.

The key covers everything the result depends on: the dataset's bytes, the
hyperparameters, the training recipe's version and the base model's files. A second
start with nothing changed reuses the directory; a changed dataset trains anew (and the
stale directory of that name is removed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.demo.catalog import DemoAdapter
from app.demo.train import TrainConfig, Trainer, load_dataset, train_lora

logger = logging.getLogger("loraplex.demo")

# Bump when train.py changes what it produces for the same inputs.
RECIPE_VERSION = 1
_KEY_CHARS = 16
# The base model's files that decide what an adapter trained on it does.
_BASE_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True, slots=True)
class TrainedAdapter:
    spec: DemoAdapter
    path: Path  # a PEFT directory
    cached: bool  # True: reused from an earlier run
    seconds: float  # training time (0 when cached)


def base_model_fingerprint(base_dir: Path) -> str:
    """sha256 over the base model's config, tokenizer and weights files (a second or
    two for SmolLM2's 540 MB; once per start)."""
    digest = hashlib.sha256()
    files = [base_dir / n for n in _BASE_MODEL_FILES if (base_dir / n).is_file()]
    files += sorted(base_dir.glob("*.safetensors"))
    for path in files:
        digest.update(f"{path.name}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(dataset: Path, config: TrainConfig, base_fingerprint: str) -> str:
    manifest = json.dumps(
        {
            "recipe": RECIPE_VERSION,
            "dataset": hashlib.sha256(dataset.read_bytes()).hexdigest(),
            "config": dataclasses.asdict(config),
            "base_model": base_fingerprint,
        },
        sort_keys=True,
    )
    return hashlib.sha256(manifest.encode()).hexdigest()[:_KEY_CHARS]


def ensure_trained(
    specs: Sequence[DemoAdapter],
    base_dir: Path,
    cache_dir: Path,
    *,
    config: TrainConfig | None = None,
    trainer: Trainer = train_lora,
    echo: Callable[[str], None] = print,
) -> list[TrainedAdapter]:
    """Each adapter's cached directory, training those that are missing or stale."""
    config = config or TrainConfig()
    fingerprint = base_model_fingerprint(base_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    trained: list[TrainedAdapter] = []
    for spec in specs:
        key = cache_key(spec.dataset, config, fingerprint)
        target = cache_dir / f"{spec.name}-{key}"
        if _is_complete(target):
            echo(f"adapter {spec.name}: cached ({target})")
            trained.append(TrainedAdapter(spec, target, cached=True, seconds=0.0))
            continue
        examples = load_dataset(spec.dataset)
        echo(f"adapter {spec.name}: training on {len(examples)} examples from "
             f"{spec.dataset.name} (once; cached afterwards) ...")
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=cache_dir))
        try:
            result = trainer(base_dir, examples, tmp, config)
            # NOTE: renamed into place when complete: an interrupted run leaves only a
            # hidden temp directory, never a half-written adapter under the final name.
            _replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_stale(cache_dir, spec.name, keep=target)
        echo(f"adapter {spec.name}: trained in {result.seconds:.0f} s, {result.steps} steps, "
             f"loss {result.first_loss:.2f} -> {result.final_loss:.2f}")
        trained.append(TrainedAdapter(spec, target, cached=False, seconds=result.seconds))
    return trained


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _ADAPTER_FILES)


def _replace(tmp: Path, target: Path) -> None:
    if target.exists():  # left incomplete by an older version: never served
        shutil.rmtree(target)
    tmp.rename(target)


def _remove_stale(cache_dir: Path, name: str, *, keep: Path) -> None:
    for path in cache_dir.glob(f"{name}-*"):
        if path != keep and path.is_dir() and len(path.name) == len(keep.name):
            logger.info("removing the outdated demo adapter %s", path)
            shutil.rmtree(path, ignore_errors=True)
