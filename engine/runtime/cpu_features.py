"""What this CPU offers a bf16 step: AMX tiles, AVX-512 BF16 dot products, or neither.

`--dtype auto` on the CPU serves bfloat16 where the CPU multiplies bf16 natively (AMX-BF16
or AVX-512 BF16: oneDNN's bf16 matmuls then run 1.5-6x its float32 ones, and the KV cache
and weights take half the memory) and float32 elsewhere, where bf16 is emulated and slower
than float32. The startup line and GET /admin/engine say what was found and picked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    model_name: str
    amx_bf16: bool  # Intel AMX tiles with bf16 (Sapphire Rapids and later)
    avx512_bf16: bool  # AVX-512 BF16 dot products (Cooper Lake, Sapphire Rapids, Zen 4+)
    avx512: bool

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run on bf16 hardware (not emulated through float32)."""
        return self.amx_bf16 or self.avx512_bf16

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


def auto_cpu_dtype(features: CpuFeatures | None = None) -> torch.dtype:
    """The dtype `--dtype auto` serves on this CPU."""
    features = features or detect_cpu_features()
    return torch.bfloat16 if features.native_bf16 else torch.float32
