"""Shared fixtures: the bundled SmolLM2, converted once into <repo>/var/ and reused."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when kernels/ is
# first imported, whichever test does it: set it before any test module is collected.
# Without CUDA the Triton kernels then run in the interpreter on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DATA_DIR = REPO_ROOT / "var"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: loads the bundled SmolLM2 model (seconds to minutes on 2 CPU cores)"
    )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (the GGUF conversion runs only once
    per checkout: about 20 s, then cached under var/models/)."""
    from engine.model_loader import resolve_model

    return resolve_model("default", CACHE_DATA_DIR)


@pytest.fixture(scope="session")
def tiny_model_factory(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """variant name (tests/utils/tiny_models.VARIANTS) -> directory of that random model,
    written once per session."""
    from tests.utils.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny_model(root / variant, smollm2_dir, variant)
        return made[variant]

    return make
