"""The prepared GPU check: every step timed, each failure recorded without stopping the
rest, one JSON report under --out, rewritten after each step so that a run cut short
still leaves what it measured.

    python -m bench.gpu.check --out DIR            # a CUDA GPU: sized for 8 min on one H200
    python -m bench.gpu.check --out DIR --dry-run  # the same steps on the CPU, tiny shapes
    python -m bench.gpu.check --out DIR --steps engine_throughput  # a rerun of some steps

bench/gpu/run.sh is the way in (it sets up the environment); docs/BENCHMARKS.md, "GPU".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

import torch

from bench.gpu.models import DRY_RUN_PLAN, GPU_PLAN, Plan, scratch_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
PLAN_ENV = "LORAPLEX_GPU_PLAN"  # tests/gpu/conftest.py: which plan's shapes the tests take
REPORT_NAME = "gpu-check.json"
LOG_NAME = "gpu-check.log"  # run.sh's

# NOTE: the steps import what they use when they run, so that a module missing on the
# device machine fails its steps, in the report, instead of the whole check.
if TYPE_CHECKING:
    from bench.gpu.engine_throughput import BenchModel

# ---------------------------------------------------------------------------- report
# A step's status. "failed": it ran and a check did not hold; "error": it raised;
# NOT_APPLICABLE_CPU: it ran what it could on the CPU, the figure it exists for needs a GPU;
# NOT_APPLICABLE_NO_TRITON: a kernel step on the CPU of a machine without triton (its
# interpreter is what runs the kernels there), not run; the step's note says so.
OK = "ok"
FAILED = "failed"
ERROR = "error"
NOT_APPLICABLE_CPU = "not-applicable (cpu)"
NOT_APPLICABLE_NO_TRITON = "not-applicable (no triton)"
NOT_RUN_BUDGET = "not-run (time budget)"
NOT_SELECTED = "not-run (not selected)"  # a rerun with --steps


@dataclass(slots=True)
class StepOutcome:
    """What a step function returns: its figures, and the checks that did not hold."""

    results: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    # Set on the CPU for a step whose figure needs a GPU (it still ran what it could).
    not_applicable: bool = False


@dataclass(slots=True)
class StepReport:
    name: str
    status: str = "pending"
    seconds: float | None = None
    error: str | None = None  # the exception, or the checks that did not hold
    note: str | None = None  # why a step that was not applicable did not run
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CheckReport:
    mode: str  # "gpu" or "dry-run"
    machine: dict[str, Any]
    steps: list[StepReport]
    schema: int = 1
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    total_s: float | None = None

    def write(self, out_dir: Path) -> None:
        path = out_dir / REPORT_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, default=str) + "\n")
        tmp.replace(path)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": len(os.sched_getaffinity(0)),
    }
    for package in ("triton", "transformers", "peft", "safetensors", "tokenizers"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    info["gpu"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sms"] = props.multi_processor_count
    return info


# ---------------------------------------------------------------------------- steps


@dataclass(slots=True)
class Context:
    plan: Plan
    device: torch.device
    work_dir: Path
    start: float = field(default_factory=time.perf_counter)
    _bench: BenchModel | None = None
    _bench_error: Exception | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def bench_model(self) -> BenchModel:
        """The throughput model, built by the first step that needs it and kept."""
        from bench.gpu.engine_throughput import BenchModel

        if self._bench_error is not None:
            raise RuntimeError("building the throughput model failed earlier") from (
                self._bench_error
            )
        if self._bench is None:
            try:
                self._bench = BenchModel(self.plan.throughput, self.device, self.work_dir)
            except Exception as exc:
                self._bench_error = exc
                raise
        return self._bench

    def close(self) -> None:
        if self._bench is not None:
            self._bench.close()
            self._bench = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def step_gpu_tests(ctx: Context) -> StepOutcome:
    """pytest -m gpu tests/gpu in a child process, on the plan's shapes (compiled where
    CUDA is): the Triton kernel tests, the kernels at serving shapes, the engine against
    HF. Each test's recorded figures come back through pytest's junit XML."""
    junit = ctx.work_dir / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
           "-o", "junit_family=xunit1", f"--junitxml={junit}", "tests/gpu"]
    if ctx.plan.test_select:
        cmd += ["-k", ctx.plan.test_select]
    # No plugin autoload: the tests need none, and the image's (or the dev venv's browser
    # and async) plugins only slow the start.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           PLAN_ENV: "dry-run" if ctx.plan.dry_run else "gpu"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=ctx.plan.tests_timeout_s)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    tests = _junit_tests(junit) if junit.exists() else {}
    outcomes = [t["outcome"] for t in tests.values()]
    passed, skipped = outcomes.count("passed"), outcomes.count("skipped")
    results = {
        "select": ctx.plan.test_select or "all",
        "compiled": ctx.on_cuda,
        "passed": passed,
        "failed": len(outcomes) - passed - skipped,
        "skipped": skipped,
        "summary": lines[-1] if lines else proc.stderr.strip()[-200:],
        "tests": tests,
    }
    ok = proc.returncode == 0 and passed > 0
    return StepOutcome(results, [] if ok else [f"pytest: {results['summary']}"])


def _junit_tests(path: Path) -> dict[str, dict[str, Any]]:
    """test id -> its outcome and the figures it recorded (record_property)."""
    tests: dict[str, dict[str, Any]] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
        figures: dict[str, Any] = {"outcome": outcome}
        for prop in case.iter("property"):
            figures[prop.get("name", "")] = _number(prop.get("value", ""))
        tests[name] = figures
    return tests


def _number(text: str) -> Any:
    """A recorded value back from its text: int, float, bool, or the text itself."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def step_kernel_bandwidth(ctx: Context) -> StepOutcome:
    from bench.gpu.kernel_checks import measure_bandwidth

    return StepOutcome(measure_bandwidth(ctx.plan, ctx.device), not_applicable=not ctx.on_cuda)


def step_engine_throughput(ctx: Context) -> StepOutcome:
    from bench.gpu.engine_throughput import check_throughput

    return StepOutcome(check_throughput(ctx.plan.throughput, ctx.bench_model()))


def step_decode_cuda_graphs(ctx: Context) -> StepOutcome:
    from bench.gpu.engine_throughput import check_decode_steps

    results = check_decode_steps(ctx.plan.throughput, ctx.bench_model())
    return StepOutcome(results, not_applicable=not ctx.on_cuda)


def step_quantized_decode(ctx: Context) -> StepOutcome:
    """The quantized schemes' decode speed and weight bytes against the unquantized
    engine (their correctness against HF: tests/gpu/test_engine_identity.py)."""
    from bench.gpu.engine_throughput import check_quantized_decode

    try:
        # No scheme starts past the check's budget: one takes well under the minute
        # run.sh leaves after it.
        results = check_quantized_decode(ctx.plan.throughput, ctx.bench_model(), ctx.device,
                                         deadline=ctx.start + ctx.plan.budget_s)
    finally:
        # It closes the throughput model to make room: a later step builds it again.
        if ctx._bench is not None:
            ctx._bench.close()
        ctx._bench = None
    problems = [f"not run (time budget): {', '.join(results['not_run'])}; rerun with "
                "--steps quantized_decode"] if results["not_run"] else []
    return StepOutcome(results, problems, not_applicable=not ctx.on_cuda)


# The steps that time the Triton kernels (compiled on a GPU, interpreted on the CPU);
# without triton, tests/gpu leaves out its kernel tests by itself (its conftest).
TRITON_STEPS = frozenset({"kernel_bandwidth"})
NO_TRITON_NOTE = (
    "triton is not installed: on the CPU its interpreter runs the kernels (`.[dev]` "
    "installs it), so the kernel steps are not applicable here; on a GPU they fail"
)

STEPS: tuple[tuple[str, Callable[[Context], StepOutcome]], ...] = (
    ("gpu_tests", step_gpu_tests),
    ("kernel_bandwidth", step_kernel_bandwidth),
    ("engine_throughput", step_engine_throughput),
    ("decode_cuda_graphs", step_decode_cuda_graphs),
    ("quantized_decode", step_quantized_decode),
)


# ---------------------------------------------------------------------------- runner


def run_step(ctx: Context, report: StepReport, fn: Callable[[Context], StepOutcome]) -> None:
    print(f"\n=== {report.name} ===", flush=True)
    start = time.perf_counter()
    try:
        outcome = fn(ctx)
    except Exception as exc:  # a step's failure must not stop the rest
        traceback.print_exc()
        report.status = ERROR
        report.error = f"{type(exc).__name__}: {exc}"
    else:
        report.results = outcome.results
        if outcome.problems:
            report.status = FAILED
            report.error = "; ".join(outcome.problems)
        else:
            report.status = NOT_APPLICABLE_CPU if outcome.not_applicable else OK
    report.seconds = round(time.perf_counter() - start, 3)
    print(f"=== {report.name}: {report.status} in {report.seconds} s", flush=True)


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def run_check(
    plan: Plan, out_dir: Path, device: torch.device, selected: set[str] | None = None
) -> CheckReport:
    """selected: the step names to run (None: all); the others are reported as not run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [StepReport(name) for name, _ in STEPS]
    mode = "dry-run" if plan.dry_run else "gpu"
    report = CheckReport(mode=mode, machine=machine_info(), steps=steps)
    report.write(out_dir)
    with tempfile.TemporaryDirectory(prefix="loraplex-gpu-check-") as tmp:
        # The 8B checkpoint (16 GB) goes to /dev/shm when it fits.
        work = Path(tmp) if plan.dry_run else scratch_dir(20 * 2**30, Path(tmp))
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(plan, device, work)
        # On the CPU triton's interpreter runs the kernels; without triton they cannot run.
        no_kernels = not ctx.on_cuda and not has_triton()
        try:
            for step, (_, fn) in zip(steps, STEPS, strict=True):
                if selected is not None and step.name not in selected:
                    step.status = NOT_SELECTED
                elif time.perf_counter() - ctx.start > plan.budget_s:
                    step.status = NOT_RUN_BUDGET
                elif step.name in TRITON_STEPS and no_kernels:
                    step.status, step.note = NOT_APPLICABLE_NO_TRITON, NO_TRITON_NOTE
                    print(f"\n=== {step.name}: {step.status}: {NO_TRITON_NOTE}", flush=True)
                else:
                    run_step(ctx, step, fn)
                report.total_s = round(time.perf_counter() - ctx.start, 3)
                report.write(out_dir)
        finally:
            ctx.close()
            if work != Path(tmp):
                shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    names = [name for name, _ in STEPS]
    parser.add_argument(
        "--steps",
        help=f"comma-separated steps to run, for a rerun (default: all): {','.join(names)}",
    )
    args = parser.parse_args(argv)
    selected = None if args.steps is None else set(args.steps.split(","))
    if selected is not None and not selected <= set(names):
        parser.error(f"unknown steps: {', '.join(sorted(selected - set(names)))}")
    if args.dry_run:
        # NOTE: triton reads it when the kernels are first decorated, i.e. imported.
        os.environ["TRITON_INTERPRET"] = "1"
        plan, device = DRY_RUN_PLAN, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("the GPU check needs CUDA; --dry-run runs it on the CPU", file=sys.stderr)
            return 2
        plan, device = GPU_PLAN, torch.device("cuda")
    report = run_check(plan, args.out, device, selected)
    print("\n" + "\n".join(f"{s.name:24} {s.status:22} {s.seconds} s" for s in report.steps))
    print(f"report: {args.out / REPORT_NAME} ({report.total_s} s)", flush=True)
    passed = (OK, NOT_APPLICABLE_CPU, NOT_APPLICABLE_NO_TRITON, NOT_SELECTED)
    return 0 if all(s.status in passed for s in report.steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
