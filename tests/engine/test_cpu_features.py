"""`--dtype auto` on the CPU: bf16 where the CPU has bf16 units, float32 elsewhere, with
the detection forced both ways; what the engine reports it picked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner, resolve_device_dtype
from engine.runtime import cpu_features
from engine.runtime.cpu_features import CpuFeatures, auto_cpu_dtype, features_from_cpuinfo

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ZEN4 = """model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16
"""
SKYLAKE = """model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz
flags\t\t: fpu sse2 avx2 avx512f avx512bw
"""
HASWELL = """model name\t: Intel(R) Xeon(R) CPU E5-2680 v3
flags\t\t: fpu sse2 avx avx2 fma
"""


def _features(text: str) -> CpuFeatures:
    found = features_from_cpuinfo(text)
    assert found is not None
    return found


@pytest.mark.parametrize(
    ("text", "speedup", "dtype", "described"),
    [
        (SAPPHIRE_RAPIDS, None, torch.bfloat16,
         "Intel(R) Xeon(R) Platinum 8480+ (AMX-BF16, AVX-512 BF16)"),
        (ZEN4, 1.8, torch.bfloat16, "AMD EPYC 9654 96-Core Processor (AVX-512 BF16)"),
        # AVX-512 BF16 without AMX where the dot-product unit is slower than float32 FMA
        # (an Intel Xeon whose hypervisor hides AMX: timed 0.55-0.64x).
        (ZEN4, 0.6, torch.float32, "AMD EPYC 9654 96-Core Processor (AVX-512 BF16)"),
        (SKYLAKE, None, torch.float32, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz "
                                       "(AVX-512, no bf16 units)"),
        (HASWELL, None, torch.float32,
         "Intel(R) Xeon(R) CPU E5-2680 v3 (no AVX-512, no bf16 units)"),
    ],
)
def test_auto_picks_bf16_only_where_the_cpu_multiplies_bf16_faster(
    text: str, speedup: float | None, dtype: torch.dtype, described: str
) -> None:
    features = _features(text)
    timed: list[float] = []

    def measure() -> float:
        # Timed only where the units alone do not decide.
        assert speedup is not None, "bf16 timed on a CPU where the flags decide"
        timed.append(speedup)
        return speedup

    assert auto_cpu_dtype(features, measure) == dtype
    assert timed == ([] if speedup is None else [speedup])
    assert features.describe() == described


def test_the_calibration_times_a_real_matmul_in_both_dtypes() -> None:
    ratio = cpu_features.measured_bf16_speedup()
    # Whatever this CPU is, both matmuls ran: a finite positive ratio, within what any
    # CPU gives (emulated bf16 at worst ~10x slower, AMX ~6x faster).
    assert 0.02 < ratio < 50


def test_this_machines_cpu_is_read_from_proc_cpuinfo() -> None:
    found = cpu_features.detect_cpu_features()
    text = Path("/proc/cpuinfo").read_text()
    assert found == _features(text)
    # torch's own detection agrees on the AVX-512 BF16 unit.
    assert found.avx512_bf16 == bool(torch.cpu._is_avx512_bf16_supported())


@pytest.fixture
def forced_cpu(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def force(text: str, bf16_speedup: float = 1.8) -> None:
        monkeypatch.setattr(cpu_features, "detect_cpu_features", lambda: _features(text))
        monkeypatch.setattr(cpu_features, "measured_bf16_speedup", lambda: bf16_speedup)

    return force


@pytest.mark.parametrize("text", [SKYLAKE, HASWELL])
def test_auto_keeps_float32_on_a_cpu_without_bf16_units(
    text: str, forced_cpu: Callable[..., None]
) -> None:
    forced_cpu(text)
    assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    # asked for, bf16 is served anyway (emulated), and float32 whatever the CPU
    assert resolve_device_dtype("cpu", "bfloat16")[1] == torch.bfloat16
    forced_cpu(SAPPHIRE_RAPIDS)
    assert resolve_device_dtype("cpu", "float32")[1] == torch.float32
    assert resolve_device_dtype("cpu", "auto")[1] == torch.bfloat16


def test_the_runner_serves_and_reports_what_auto_picked(
    forced_cpu: Callable[..., None], tiny_model_factory: Callable[[str], Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    config = EngineConfig(device="cpu", dtype="auto", kv_cache_tokens=256, max_loras=0)
    forced_cpu(HASWELL)
    with caplog.at_level("INFO", logger="engine.core.model_runner"):
        runner = ModelRunner(config, model_dir)
    assert runner.dtype == torch.float32
    assert runner.model.embed_tokens.weight.dtype == torch.float32
    assert runner.compute == "Intel(R) Xeon(R) CPU E5-2680 v3 (no AVX-512, no bf16 units)"
    assert "float32 (--dtype auto; Intel(R) Xeon(R) CPU E5-2680 v3" in caplog.text
    forced_cpu(ZEN4)
    runner = ModelRunner(config, model_dir)
    assert runner.dtype == torch.bfloat16
    assert runner.kv_caches[0].key.dtype == torch.bfloat16
    assert runner.compute == ("AMD EPYC 9654 96-Core Processor (AVX-512 BF16); a bf16 "
                              "matmul ran 1.80x float32's here")
    forced_cpu(ZEN4, 0.6)
    runner = ModelRunner(config, model_dir)
    assert runner.dtype == torch.float32
    assert runner.compute.endswith("a bf16 matmul ran 0.60x float32's here")


def test_the_engine_dtype_comes_from_loraplex_dtype_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LORAPLEX_DTYPE", raising=False)
    assert EngineConfig().dtype == "auto"
    monkeypatch.setenv("LORAPLEX_DTYPE", "bfloat16")
    assert EngineConfig().dtype == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"
