"""What every benchmark's report shares: the machine it ran on, the header of options, a
printed row, and the JSON file."""

from __future__ import annotations

import contextlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

# Where reports go unless --output says otherwise: bench/results/<name>-<timestamp>.json.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows of it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """One line: the CPU, the threads torch uses, the versions; the GPU where one runs."""
    text = (
        f"{platform.machine()} {cpu_model()} cores={torch.get_num_threads()} "
        f"torch={torch.__version__} python={platform.python_version()}"
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        text += f" gpu={props.name} sms={props.multi_processor_count} cuda={torch.version.cuda}"
        with contextlib.suppress(ImportError):
            import triton

            text += f" triton={triton.__version__}"
    return text


@dataclass(slots=True)
class ReportHead:
    """What the reports of the larger benchmarks start with (their dataclasses extend
    it): the options, machine_description() and when the run started."""

    options: Any
    machine: str
    started_at: str


def report_header(name: str, opts: Any) -> dict[str, Any]:
    """What every benchmark report starts with; `opts`: its options dataclass (without
    the output path)."""
    return {
        "benchmark": name,
        "machine": machine_description(),
        "options": options_json(opts, exclude=("output",)),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def options_json(opts: Any, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """An options dataclass's fields (less `exclude`) as JSON values."""
    return {f.name: jsonable(getattr(opts, f.name)) for f in fields(opts) if f.name not in exclude}


def jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_report(report: dict[str, Any], output: Path | None) -> None:
    """The report as indented JSON at `output` (its folder made); nothing when None."""
    if output is not None:
        _write_json(output, report)


def print_row(label: str, row: object) -> None:
    print(f"{label:>20}: {json.dumps(row)}", flush=True)


def save_report(
    data: Any, name: str, output: Path | None, *, say: Callable[[str], object] = print
) -> Path:
    """`data` as indented JSON at `output`, or at RESULTS_DIR/<name>-<timestamp>.json;
    says where, and returns the path."""
    path = output or RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    _write_json(path, data)
    say(f"report: {path}")
    return path
