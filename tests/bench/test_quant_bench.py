"""`loraplex bench quant-kernels` and `quant-load` run on this machine's CPU (whatever
its instruction sets) and report what they measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.quantization import (
    QuantKernelsOptions,
    QuantLoadOptions,
    run_quant_kernels,
    run_quant_load,
)
from loraplex_kernels import cpu_gemm, cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")


def test_quant_kernels_times_every_way_at_each_row_count(tmp_path: Path) -> None:
    report = run_quant_kernels(QuantKernelsOptions(rows=(1, 5), layers=1, repeats=1,
                                                   output=tmp_path / "k.json"))
    assert set(report) == {"1", "5"}
    for timings in report.values():
        # float32 and bf16 (oneDNN's packed layers where it packs them, else torch's
        # matmul), our int8 (float32 and bf16 rows, and wide activations), int4 and w8a8,
        # torch's int8 and int4; our bf16 kernel where the CPU has AVX-512 BF16.
        assert len(timings) == 9 + cpu_gemm.available(), timings
        assert {"ours int8", "ours int8 (bf16 rows)", "ours int8, wide activations (bf16)",
                "ours int4", "ours w8a8 (bf16)"} <= set(timings)
        assert all(ms > 0 for ms in timings.values()), timings
    assert (tmp_path / "k.json").is_file()


def test_quant_load_reports_each_schemes_load(tiny_model_factory, tmp_path: Path) -> None:
    rows = run_quant_load(QuantLoadOptions(model=str(tiny_model_factory("llama_gqa")),
                                           schemes=("none", "int4"),
                                           output=tmp_path / "l.json"))
    none, int4 = rows
    assert none["source"] == int4["source"] == "float checkpoint"
    assert int4["weight_bytes"] < 0.5 * none["weight_bytes"]
    assert all(r["load_s"] > 0 and r["peak_rss_mib"] >= r["rss_before_mib"] for r in rows)
