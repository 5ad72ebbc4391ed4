"""`loraplex bench roofline` on a tiny model: the report holds the machine's figures, each
scenario's step parts, and the alternated comparisons asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bench.roofline import RooflineOptions, run_roofline


def test_a_short_run_reports_parts_and_both_comparisons(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    output = tmp_path / "roofline.json"
    run_roofline(RooflineOptions(
        model=str(tiny_model_factory("llama_gqa")), num_seqs=4, context_len=(8, 24),
        num_adapters=0, steps=2, profiled_steps=1, repeats=1, compare_gather=True,
        compare_cpu_ops=True, output=output,
    ))
    report = json.loads(output.read_text())
    assert report["matmul_peak_gflops"] > 0 and min(report["bandwidth_gb_s"].values()) > 0
    base = report["decode"]["base"]
    assert base["step_ms"] > 0 and base["roofline_fraction"] > 0
    assert {"linear", "lm_head", "python"} <= set(base["parts_ms"])
    assert set(base["kernel_vs_gather_step_ms"]) == {"kernel", "gather"}
    assert set(base["fused_vs_torch_step_ms"]) == {"fused", "torch"}
    assert all(v > 0 for v in base["fused_vs_torch_step_ms"].values())
