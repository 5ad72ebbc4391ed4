"""bench/gpu/run.sh --dry-run: the prepared GPU check end to end on the CPU (interpreted
kernels, tiny random models), and the shape of the report it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu.check import LOG_NAME, NOT_APPLICABLE_CPU, OK, REPORT_NAME, STEPS

REPO_ROOT = Path(__file__).resolve().parents[2]
# The steps whose figure needs a GPU: they run what they can and say so.
CPU_NOT_APPLICABLE = {"kernel_bandwidth", "decode_cuda_graphs", "quantized_decode"}
STEP_FIELDS: dict[str, set[str]] = {
    "gpu_tests": {"compiled", "passed", "failed", "skipped", "summary", "tests"},
    "kernel_bandwidth": {"timer", "copy_bytes_per_s", "aim_fraction", "best_fraction", "cases"},
    "engine_throughput": {
        "kv_cache",
        "engine_vs_hf_static",
        "lora_overhead",
        "engine_vs_peft_adapter_names",
        "setup_s",
    },
    "decode_cuda_graphs": {"cuda_graphs", "decode"},
    "quantized_decode": {"model", "dtype", "schemes", "float32", "int8", "int4"},
}
QUANTIZED_FIGURES = {"load_s", "weight_bytes", "greedy_equal_of_4", "decode",
                     "weight_bytes_vs_unquantized", "decode_tok_s_vs_unquantized"}
IDENTITY_FIGURES = {
    "requests",
    "adapter_requests",
    "fp32_identical",
    "adapter_outputs_differing_from_base",
    "bf16_positions",
    "new_tokens",
    "bf16_engine_top1_agreement",
    "bf16_hf_top1_agreement",
    "bf16_engine_vs_hf_bf16_agreement",
}
BANDWIDTH_CASE_FIELDS = {"group", "op", "bytes_moved", "bytes_per_s", "fraction_of_copy"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-out")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu/run.sh", "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert (out / LOG_NAME).read_text().strip(), "empty log"
    return json.loads((out / REPORT_NAME).read_text())


def test_every_step_ran_with_the_expected_status(report: dict[str, Any]) -> None:
    assert report["mode"] == "dry-run"
    assert [s["name"] for s in report["steps"]] == [name for name, _ in STEPS]
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    want = {name: NOT_APPLICABLE_CPU if name in CPU_NOT_APPLICABLE else OK for name, _ in STEPS}
    assert statuses == want, [(s["name"], s["error"]) for s in report["steps"]]
    for step in report["steps"]:
        assert step["error"] is None
        assert isinstance(step["seconds"], float) and step["seconds"] > 0
    assert report["total_s"] >= sum(s["seconds"] for s in report["steps"]) * 0.99


def test_steps_report_their_fields(report: dict[str, Any]) -> None:
    steps = {s["name"]: s["results"] for s in report["steps"]}
    for name, fields in STEP_FIELDS.items():
        assert fields <= set(steps[name]), (name, fields - set(steps[name]))

    tests = steps["gpu_tests"]
    assert tests["compiled"] is False and tests["failed"] == tests["skipped"] == 0
    # The two selected kernel tests (parametrized), both dtypes of the serving shapes,
    # the engine against HF, the quantized kernel and engines: each passed, with its
    # figures.
    assert tests["passed"] == len(tests["tests"]) >= 5
    assert {t["outcome"] for t in tests["tests"].values()} == {"passed"}
    accuracy = {name: t for name, t in tests["tests"].items() if "serving_shapes" in name}
    assert len(accuracy) == 2  # fp16, bf16
    for figures in accuracy.values():
        errors = {k: v for k, v in figures.items() if k.endswith("max_abs_err")}
        # 4 groups x 2 batches x 2 ops, and the worst of each op: 18
        assert len(errors) == 18
        assert all(0 <= e <= 2e-2 + 2e-2 * 10 for e in errors.values())
        assert figures["compiled"] is False

    (identity,) = [t for name, t in tests["tests"].items() if "engine_matches_hf" in name]
    assert set(identity) >= IDENTITY_FIGURES
    assert identity["fp32_identical"] == identity["requests"]
    assert identity["requests"] > identity["adapter_requests"] > 0
    assert identity["adapter_outputs_differing_from_base"] > 0
    assert identity["bf16_positions"] == identity["requests"] * identity["new_tokens"]
    assert 0 <= identity["bf16_engine_top1_agreement"] <= 1

    bandwidth = steps["kernel_bandwidth"]
    assert bandwidth["copy_bytes_per_s"] > 0
    for case in bandwidth["cases"]:
        assert set(case) >= BANDWIDTH_CASE_FIELDS and case["bytes_moved"] > 0

    throughput = steps["engine_throughput"]
    assert throughput["kv_cache"]["tokens"] > 0
    for pair in [
        *throughput["engine_vs_hf_static"].values(),
        *throughput["engine_vs_peft_adapter_names"].values(),
    ]:
        assert pair["engine"]["output_tokens"] == pair["baseline"]["output_tokens"] > 0
        assert pair["engine_vs_baseline"] > 0
    assert throughput["lora_overhead"]["lora_vs_base_step_time"] > 0

    decode = steps["decode_cuda_graphs"]
    assert decode["cuda_graphs"] == "not implemented"
    assert all(row["eager_step_ms_median"] > 0 for row in decode["decode"].values())

    # The quantized engines (the CPU's kernels here): each against HF on its dequantized
    # weights, and timed beside the unquantized one.
    quantized = [t for name, t in tests["tests"].items() if "quantized_engine_greedy" in name]
    assert len(quantized) == 2  # int8, int4 (fp8 needs a GPU of compute capability 8.9)
    for figures in quantized:
        assert figures["identical"] == figures["requests"] > 0 and figures["weight_bytes"] > 0
    (kernel,) = [t for name, t in tests["tests"].items() if "quant_kernel_at_model" in name]
    errors = [v for k, v in kernel.items() if k.endswith("max_abs_err")]
    assert len(errors) == 4 * 3 * 3 and all(0 <= e < 0.1 for e in errors)
    q = steps["quantized_decode"]
    assert q["schemes"] == ["int8", "int4"]
    for scheme in q["schemes"]:
        assert set(q[scheme]) >= QUANTIZED_FIGURES
        assert 0 < q[scheme]["weight_bytes_vs_unquantized"] < 1
        assert 0 <= q[scheme]["greedy_equal_of_4"] <= 4
        for mix in ("base", "adapters"):
            assert all(row["decode_tok_s"] > 0 for row in q[scheme]["decode"][mix].values())


def test_without_triton_the_kernel_steps_are_not_applicable(tmp_path: Path) -> None:
    # The interpreter runs the kernels on the CPU; a machine without triton (the demo's
    # install, say) runs the other steps, and the kernel steps say why they did not run.
    from bench.gpu.check import NOT_APPLICABLE_NO_TRITON, TRITON_STEPS

    blocked = ("import sys; sys.modules['triton'] = None\n"
               "from bench.gpu.check import main; raise SystemExit(main())")
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "--dry-run", "--out", str(tmp_path),
         "--steps", ",".join(sorted(TRITON_STEPS))],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((tmp_path / REPORT_NAME).read_text())["steps"]}
    for name in TRITON_STEPS:
        assert steps[name]["status"] == NOT_APPLICABLE_NO_TRITON, steps[name]
        assert steps[name]["error"] is None
        assert "triton is not installed" in steps[name]["note"]
    assert "Traceback" not in proc.stdout + proc.stderr
