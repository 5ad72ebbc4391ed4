"""The GPU check's report: one JSON file, rewritten after every step so that a run cut
short still leaves what it measured."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# A step's status. "failed": it ran and a check did not hold; "error": it raised;
# NOT_APPLICABLE_CPU: it ran what it could on the CPU, the figure it exists for needs a GPU;
# NOT_APPLICABLE_NO_TRITON: a kernel step on the CPU of a machine without triton (its
# interpreter is what runs the kernels there), not run; the step's note says so.
OK = "ok"
FAILED = "failed"
ERROR = "error"
PENDING = "pending"
NOT_APPLICABLE_CPU = "not-applicable (cpu)"
NOT_APPLICABLE_NO_TRITON = "not-applicable (no triton)"
NOT_RUN_BUDGET = "not-run (time budget)"
NOT_SELECTED = "not-run (not selected)"  # a rerun with --steps

REPORT_NAME = "gpu-check.json"
LOG_NAME = "gpu-check.log"
SCHEMA_VERSION = 1


@dataclass(slots=True)
class StepReport:
    name: str
    status: str = PENDING
    seconds: float | None = None
    error: str | None = None  # the exception, or the checks that did not hold
    note: str | None = None  # why a step that was not applicable did not run
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CheckReport:
    mode: str  # "gpu" or "dry-run"
    machine: dict[str, Any]
    steps: list[StepReport]
    schema: int = SCHEMA_VERSION
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    total_s: float | None = None

    def write(self, out_dir: Path) -> Path:
        path = out_dir / REPORT_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, default=_jsonable) + "\n")
        tmp.replace(path)
        return path


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": _cpu_count(),
    }
    for package in ("triton", "transformers", "peft", "safetensors", "tokenizers"):
        info[package] = _version(package)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sms"] = props.multi_processor_count
    else:
        info["gpu"] = None
    return info


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


@dataclass(slots=True)
class StepOutcome:
    """What a step function returns: its figures, and the checks that did not hold."""

    results: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    # Set on the CPU for a step whose figure needs a GPU (it still ran what it could).
    not_applicable: bool = False
