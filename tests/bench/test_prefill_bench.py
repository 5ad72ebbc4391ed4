"""`loraplex bench prefill-attention` times torch's kernel and each of loraplex's this CPU
has, with their errors, and a tiny model's prefill step with the kernel on and off."""

from __future__ import annotations

from pathlib import Path

from bench.prefill import PrefillAttentionOptions, run_prefill_attention
from loraplex_kernels import cpu_attention


def test_prefill_attention_times_each_kernel_here(tiny_model_factory, tmp_path: Path) -> None:
    report = run_prefill_attention(PrefillAttentionOptions(
        model=str(tiny_model_factory("llama_gqa")), prompt_len=(5, 40), num_prompts=3,
        repeats=1, output=tmp_path / "p.json",
    ))
    layer = report["one_layer"]
    want = {"torch_flash"} | ({"dot_product"} if cpu_attention.available() else set()) | (
        {"amx_tiles"} if cpu_attention.uses_tiles() else set())
    assert set(layer) == want
    for row in layer.values():
        assert row["ms"] > 0 and row["gflops"] > 0
        assert row["max_abs_error"] < 0.05  # bf16 rounding, not a wrong result
    assert set(report["prefill_step_ms"]) == {"kernel", "torch_flash"}
    assert all(ms > 0 for ms in report["prefill_step_ms"].values())
    assert (tmp_path / "p.json").is_file()
