"""The GPU check's correctness tests (marker `gpu`; bench/gpu/run.sh runs them): compiled
on CUDA, else the Triton kernels in triton's interpreter on the CPU. The shapes are the
plan's (bench/gpu/models.py): LORAPLEX_GPU_PLAN=gpu takes the GPU plan's (the check sets it
on a GPU), anything else the dry run's tiny ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.gpu.check import PLAN_ENV, has_triton
from bench.gpu.models import DRY_RUN_PLAN, GPU_PLAN, Plan

# NOTE: triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, that is when
# loraplex_kernels.lora_shrink / .lora_expand are first imported; conftest runs before
# the test modules of this folder import them.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Without triton nothing runs the kernels on the CPU (the demo's install lacks it): their
# modules are left out there. On CUDA they stay, and fail.
collect_ignore = ([] if has_triton() or torch.cuda.is_available()
                  else ["test_lora_kernels.py", "test_kernel_accuracy.py",
                        "test_quant_kernels.py"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def plan() -> Plan:
    return GPU_PLAN if os.environ.get(PLAN_ENV) == "gpu" else DRY_RUN_PLAN


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scratch for the random models and adapters."""
    return tmp_path_factory.mktemp("gpu-tests")
