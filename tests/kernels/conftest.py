"""The kernel tests run compiled on CUDA, else in triton's interpreter on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, that is when
# loraplex_kernels.lora_shrink / .lora_expand are first imported; conftest runs before
# the test modules of this folder import them.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
