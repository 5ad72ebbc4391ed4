"""What this CPU offers a bf16 step: AMX tiles, AVX-512 BF16 dot products, or neither.

`--dtype auto` on the CPU serves bfloat16 where the CPU multiplies bf16 faster than float32
(the KV cache and weights then take half the memory too) and float32 elsewhere. AMX-BF16
tiles always are (oneDNN's bf16 matmuls ran 5-6x its float32 ones). AVX-512 BF16 dot
products alone differ by CPU: 1.5-2x float32 on Zen 4, but 0.55-0.64x on an Intel Xeon
whose hypervisor hides AMX (oneDNN's bf16 kernel there is the dot-product instruction's;
the served burst went 134-139 tok/s at float32 against 109-120 at bf16). There a prefill-sized
matmul is timed once at start in both dtypes, and bf16 is served only if it wins. The
startup line and GET /admin/engine say what was found, measured and picked.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    model_name: str
    amx_bf16: bool  # Intel AMX tiles with bf16 (Sapphire Rapids and later)
    avx512_bf16: bool  # AVX-512 BF16 dot products (Cooper Lake, Sapphire Rapids, Zen 4+)
    avx512: bool

    def describe(self) -> str:
        units = [name for name, has in (("AMX-BF16", self.amx_bf16),
                                        ("AVX-512 BF16", self.avx512_bf16)) if has]
        if not units:
            units = ["AVX-512, no bf16 units" if self.avx512 else "no AVX-512, no bf16 units"]
        return f"{self.model_name or 'unknown CPU'} ({', '.join(units)})"


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """/proc/cpuinfo's first model name and flags."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if model and flags:
            break
    return model, flags


def features_from_cpuinfo(text: str) -> CpuFeatures | None:
    """What /proc/cpuinfo's text says; None when it lists no flags."""
    model, flags = parse_cpuinfo(text)
    if not flags:
        return None
    return CpuFeatures(
        model_name=model,
        amx_bf16="amx_bf16" in flags,
        avx512_bf16="avx512_bf16" in flags,
        avx512="avx512f" in flags,
    )


@functools.cache
def detect_cpu_features() -> CpuFeatures:
    """This machine's CPU, read once: /proc/cpuinfo's flags where there are any, else
    what torch's cpuinfo reports."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    found = features_from_cpuinfo(text)
    if found is not None:
        return found
    model, _ = parse_cpuinfo(text)
    return CpuFeatures(
        model_name=model,
        amx_bf16=bool(torch.cpu._is_amx_tile_supported()),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        avx512=bool(torch.cpu._is_avx512_supported()),
    )


# bf16 must beat float32 by this much on the timed matmul to be picked without AMX.
BF16_MIN_SPEEDUP = 1.1
# The timed matmul: [rows, in] x [in, out], a prefill step's layer in a small model.
_CALIBRATION_SHAPE = (512, 1024, 1024)


@functools.cache
def measured_bf16_speedup() -> float:
    """float32's time over bf16's for one prefill-sized matmul on this process's threads
    (best of 5 after a warm-up each; ~50 ms in all). Above 1: bf16 is faster here."""
    rows, k, n = _CALIBRATION_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)

    def best(dtype: torch.dtype) -> float:
        xd, wd = x.to(dtype), w.to(dtype)
        torch.nn.functional.linear(xd, wd)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def auto_cpu_dtype(features: CpuFeatures | None = None,
                   bf16_speedup: Callable[[], float] | None = None) -> torch.dtype:
    """The dtype `--dtype auto` serves on this CPU: bf16 with AMX-BF16; with AVX-512 BF16
    alone where `bf16_speedup()` (default: measured_bf16_speedup, timed once) is at least
    BF16_MIN_SPEEDUP; else float32."""
    features = features or detect_cpu_features()
    if features.amx_bf16:
        return torch.bfloat16
    speedup = bf16_speedup or measured_bf16_speedup
    if features.avx512_bf16 and speedup() >= BF16_MIN_SPEEDUP:
        return torch.bfloat16
    return torch.float32


def describe_dtype_choice(features: CpuFeatures | None = None) -> str:
    """What the startup line says of the CPU (and, where bf16 was timed, the ratio)."""
    features = features or detect_cpu_features()
    text = features.describe()
    if features.avx512_bf16 and not features.amx_bf16:
        text += f"; a bf16 matmul ran {measured_bf16_speedup():.2f}x float32's here"
    return text
