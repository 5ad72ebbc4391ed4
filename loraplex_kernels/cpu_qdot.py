"""Linear layers on int8 weights and int8 activations on the CPU (`--quantization w8a8`).

Weights are symmetric int8 per output channel (as `--quantization int8` holds them), or,
"grouped", with a scale per output channel and group of the activations' inputs (the output
projection's int8 in groups of 32, GGUF's Q8_0 grid).
Activations are quantized as each step runs: every row in groups of ACT_GROUP inputs, one
scale per group (max |x| / 127), rounded to nearest even. The products are summed exactly
in int32 per group and scaled in float32 (cpu_qdot.c has the arithmetic, step by step).

Why: at a decode step of a few dozen rows the linear layers are bound by arithmetic, not by
reading weights, so int8 weights multiplied as bf16 (`--quantization int8`) cannot be
faster than the bf16 model; AVX-512 VNNI's `vpdpbusd` does 64 int8 multiply-adds an
instruction where `vdpbf16ps` does 32. Groups of 64 rather than one scale per row: per-row
activation scales raised the bundled SmolLM2's perplexity by 2.3%, groups of 64 by 0.4%
(docs/BENCHMARKS.md, "w8a8").

With `wide` weights (`pack(..., wide=True)`; what `--quantization int8` runs at bf16 on a CPU
with AVX-512 VNNI) the activations are quantized per row to 16-bit integers instead, split
into two bytes, and each column takes two integer sums: weight-only int8 in its precision
(a 16-bit grid per row is finer than bf16 inputs near the row's largest), at the bf16 dot
product's rate of multiply-adds, on half its weight bytes and with no conversion of the
integers to floats (docs/BENCHMARKS.md, "int8 weights against 16-bit activations").

`reference_linear` is the same computation in torch ops (float64 sums): what the kernel is
tested against; `fake_quantize` is what the activations stand for, for a Hugging Face
oracle, and, over the dequantized weights in float32, the fallback without a compiler.

NOTE: C in cpu_qdot.c, built by cpu_build.py for the CPU it runs on and called through
ctypes with the GIL released. Without AVX-512 VNNI the build runs generic loops with the
same results (bit for bit), much slower; `variant()` says which.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from loraplex_kernels import cpu_quant
from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary

BLOCK = 16  # output columns per block of the layout
ACT_GROUP = 64  # activations' inputs per scale, where the layer's inputs divide by it
MAX_GROUP = 1024  # the most inputs of a group pack takes (the kernel's int32 sums hold them)
WIDE_MAX_K = 32768  # the most inputs of a wide layer (its int32 sums hold them)
WIDE_MAX_GROUP = 256  # the most inputs of a wide layer's group (H * 256 + L in int32)
WIDE_LEVELS = 32767.0  # a wide row's integers: -32767..32767, max |x| / WIDE_LEVELS a step


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.qdot_variant.argtypes, lib.qdot_variant.restype = [], i32
    lib.qdot_linear.argtypes = [ptr, i64, i32, i64, i64, i64, ptr, ptr, i32, ptr, i64, ptr,
                                i64, i32, i64]
    lib.qdot_linear.restype = i32
    lib.qdot16_linear.argtypes = [ptr, i64, i32, i64, i64, i64, ptr, ptr, ptr, i32, ptr, i64,
                                  ptr, i64, i32, i64]
    lib.qdot16_linear.restype = i32


_library = LazyLibrary("cpu_qdot", SOURCE_DIR / "cpu_qdot.c", _declare).get
# The generic loops on any CPU (tests compare the two builds).
_generic = LazyLibrary("cpu_qdot_generic", SOURCE_DIR / "cpu_qdot.c", _declare,
                       defines={"QDOT_GENERIC": 1}).get


def available() -> bool:
    return _library() is not None


def variant() -> str:
    """'vnni' (AVX-512 VNNI tiles), 'generic' (the plain loops) or 'torch' (no kernel)."""
    lib = _library()
    if lib is None:
        return "torch"
    return "vnni" if lib.qdot_variant() else "generic"


def act_group(in_features: int) -> int:
    """The activations' group size for a layer of `in_features` inputs: ACT_GROUP, or the
    largest of 32, 16, 8, 4 that divides it. ValueError where none does."""
    for group in (ACT_GROUP, 32, 16, 8, 4):
        if in_features % group == 0:
            return group
    raise ValueError(f"{in_features} input features (w8a8 needs a multiple of 4)")


@dataclass(frozen=True, slots=True)
class QDotWeight:
    """A [out_features, in_features] int8 weight in the kernel's layout.

    packed: uint8 [N / 16 * K / 4 * 64] (q + 128, blocks of 16 columns by 4 inputs);
    scales: float32 [N], one per output channel, or grouped [N / 16, K / act_group, 16], one
    per output channel and group of act_group inputs; colsums: int32 [N], each column's
    sum of q, where the activations are wide (16-bit integers per row), else None."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    act_group: int
    grouped: bool = False
    colsums: torch.Tensor | None = None

    bits = 8

    @property
    def wide(self) -> bool:
        """Whether the activations are 16-bit integers per row (int8 weight-only), not int8
        in groups (w8a8)."""
        return self.colsums is not None

    @property
    def group_size(self) -> int:
        """Inputs per weight scale."""
        return self.act_group if self.grouped else self.in_features

    def scale_rows(self) -> torch.Tensor:
        """The weight scales as [N, K / group_size]."""
        n = self.out_features
        if not self.grouped:
            return self.scales[:, None]
        return self.scales.transpose(1, 2).reshape(n, -1)

    @property
    def nbytes(self) -> int:
        wide = 0 if self.colsums is None else self.colsums.numel() * 4
        return self.packed.numel() + self.scales.numel() * 4 + wide


def wide_fits(n: int, k: int, group: int | None = None) -> bool:
    """Whether a [n, k] layer (weights per output channel, or per group of `group` inputs)
    can hold wide activations."""
    g = k if group is None else group
    return (n % BLOCK == 0 and k % 4 == 0 and 0 < k <= WIDE_MAX_K and g % 4 == 0
            and k % g == 0 and (g == k or g <= WIDE_MAX_GROUP))


def runs_wide(n: int, k: int, group: int | None, dtype: torch.dtype) -> bool:
    """Whether int8 weights of that shape take wide activations for `dtype` inputs here:
    bf16 on a CPU with AVX-512 VNNI (elsewhere the generic loops would be the slow path)."""
    return dtype == torch.bfloat16 and wide_fits(n, k, group) and variant() == "vnni"


def pack(q: torch.Tensor, scales: torch.Tensor, group: int | None = None, *,
         wide: bool = False) -> QDotWeight:
    """Integers q [N, K] (int8 in -127..127) with float scales [N] (or [N, 1]; with `group`
    [N, K / group], the activations then quantized in the same groups) -> the kernel's
    layout; `wide`: per output channel only, the activations as 16-bit integers per row.
    ValueError for shapes or values it cannot hold."""
    n, k = q.shape
    g = k if group is None else group
    grouped = g != k
    scales = scales.float().reshape(n, -1) if grouped else scales.reshape(-1).float()
    problems = []
    if wide and grouped and g > WIDE_MAX_GROUP:
        problems.append(f"groups of {g} (wide activations take at most {WIDE_MAX_GROUP})")
    if wide and k > WIDE_MAX_K:
        problems.append(f"{k} input features (wide activations take at most {WIDE_MAX_K})")
    if n % BLOCK:
        problems.append(f"{n} output features (a multiple of {BLOCK} is needed)")
    if k % 4:
        problems.append(f"{k} input features (a multiple of 4 is needed)")
    if grouped and (g <= 0 or g % 4 or k % g or g > MAX_GROUP):
        problems.append(f"groups of {g} for {k} input features (a multiple of 4 that "
                        f"divides them, at most {MAX_GROUP}, is needed)")
    elif grouped and scales.shape != (n, k // g):
        problems.append(f"scales {tuple(scales.shape)} for {n} x {k} in groups of {group}")
    elif not grouped and scales.numel() != n:
        problems.append(f"{scales.numel()} scales for {n} output features")
    if problems:
        raise ValueError("w8a8 weight refused: " + "; ".join(problems))
    qi = q.to(torch.int16)
    if bool(((qi < -127) | (qi > 127)).any()):
        raise ValueError("w8a8 weight refused: integers outside -127..127")
    unsigned = (qi + 128).to(torch.uint8)
    packed = unsigned.reshape(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    if grouped:
        blocked = scales.reshape(n // BLOCK, BLOCK, k // g).transpose(1, 2).contiguous()
        colsums = None
        if wide:  # [N / 16, K / g, 16], as the scales
            sums = qi.reshape(n, k // g, g).sum(-1, dtype=torch.int32)
            colsums = sums.reshape(n // BLOCK, BLOCK, k // g).transpose(1, 2).contiguous()
        return QDotWeight(packed.reshape(-1), blocked, n, k, g, grouped=True, colsums=colsums)
    colsums = qi.sum(1, dtype=torch.int32).contiguous() if wide else None
    return QDotWeight(packed.reshape(-1), scales.contiguous(), n, k,
                      k if wide else act_group(k), colsums=colsums)


def quantize(weight: torch.Tensor, group: int | None = None) -> QDotWeight:
    """Round-to-nearest symmetric int8 per output channel (as `--quantization int8`), or per
    output channel and group of `group` inputs: cpu_quant.quantize_integers' integers and
    scales, in this kernel's layout."""
    q, scales, _, _ = cpu_quant.quantize_integers(weight, 8, group)
    return pack(q, scales, group)


def integers(qw: QDotWeight) -> torch.Tensor:
    """The weight's integers [N, K] (int16), from the layout."""
    n, k = qw.out_features, qw.in_features
    blocks = qw.packed.view(n // BLOCK, k // 4, BLOCK, 4).permute(0, 2, 1, 3)
    return blocks.reshape(n, k).to(torch.int16) - 128


def dequantize(qw: QDotWeight) -> torch.Tensor:
    """The float32 weight [N, K] the integers stand for."""
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    return (integers(qw).float().view(n, k // g, g) * qw.scale_rows()[..., None]).view(n, k)


def _quantize_groups(x: torch.Tensor, group: int, levels: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (integers [..., K] float32 in -levels..levels, scales [..., K / group]):
    s = max |x| / levels per group (float32), round(x / s) to nearest even; a group of
    zeros has s = 0 and zeros, a group with a NaN or an infinity a NaN scale."""
    xf = x.float()
    shape = xf.shape
    xg = xf.reshape(*shape[:-1], shape[-1] // group, group)
    amax = xg.abs().amax(-1)
    bad = ~torch.isfinite(xg).all(-1)
    scale = torch.where(bad, torch.full_like(amax, float("nan")), amax / levels)
    usable = (scale > 0) & ~bad
    safe = torch.where(usable, scale, torch.ones_like(scale))
    q = torch.round(xg / safe[..., None]).clamp_(-levels, levels)
    q = torch.where(usable[..., None], q, torch.zeros_like(q))
    return q.reshape(shape), scale


def quantize_activations(x: torch.Tensor, group: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (integers [..., K] float32 in -127..127, scales [..., K / group]), as
    the w8a8 kernel quantizes them (_quantize_groups, 127 levels a side)."""
    return _quantize_groups(x, group, 127.0)


def quantize_activations16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (integers [..., K] float32 in -32767..32767, scales [...]), as the wide
    kernel quantizes each row (_quantize_groups, one group a row)."""
    q, scale = _quantize_groups(x, x.shape[-1], WIDE_LEVELS)
    return q, scale[..., 0]


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """The values x's int8 activations stand for (integers x scales), in x's dtype: what a
    float model's linear layers are fed to stand for this kernel's inputs."""
    q, scale = quantize_activations(x, group)
    shape = q.shape
    qg = q.reshape(*shape[:-1], shape[-1] // group, group)
    return (qg * scale[..., None]).reshape(shape).to(x.dtype)


def reference_linear(x: torch.Tensor, qw: QDotWeight, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`linear` in torch ops, the sums in float64: the definition the kernel is tested
    against."""
    if qw.wide:
        q16, row_scale = quantize_activations16(x)
        t, k = q16.shape
        g = qw.group_size
        per_group = torch.einsum("tgk,ngk->tgn", q16.double().reshape(t, k // g, g),
                                 integers(qw).double().reshape(-1, k // g, g))
        total = (per_group * qw.scale_rows().double().t()).sum(1) \
            * row_scale.double()[:, None]
        if bias is not None:
            total = total + bias.double()
        return total.to(x.dtype)
    group = qw.act_group
    q, scale = quantize_activations(x, group)
    t, k = q.shape
    ints = integers(qw).double()  # [N, K]
    per_group = torch.einsum("tgk,ngk->tgn", q.double().reshape(t, k // group, group),
                             ints.reshape(-1, k // group, group))
    if qw.grouped:
        total = (per_group * scale.double()[..., None] * qw.scale_rows().double().t()).sum(1)
    else:
        total = (per_group * scale.double()[..., None]).sum(1) * qw.scales.double()
    if bias is not None:
        total = total + bias.double()
    return total.to(x.dtype)


def linear(x: torch.Tensor, qw: QDotWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, *, generic: bool = False) -> torch.Tensor:
    """x [T, K] float32 or bf16 . W^T (+ bias float32 [N]) -> [T, N] in x's dtype (into
    `out` [T, N] when given: rows of any stride, unit stride within a row). `generic`: the
    generic loops' build whatever the CPU has (tests)."""
    lib = _generic() if generic else _library()

    def launch(xc: torch.Tensor, y: torch.Tensor, bf16: int) -> int:
        assert lib is not None
        if qw.wide:
            assert qw.colsums is not None
            return int(lib.qdot16_linear(
                xc.data_ptr(), xc.stride(0), bf16, xc.shape[0], xc.shape[1], qw.act_group,
                qw.packed.data_ptr(), qw.scales.data_ptr(), qw.colsums.data_ptr(),
                int(qw.grouped), None if bias is None else bias.data_ptr(), qw.out_features,
                y.data_ptr(), y.stride(0), bf16, torch.get_num_threads()))
        return int(lib.qdot_linear(
            xc.data_ptr(), xc.stride(0), bf16, xc.shape[0], xc.shape[1], qw.act_group,
            qw.packed.data_ptr(), qw.scales.data_ptr(), int(qw.grouped),
            None if bias is None else bias.data_ptr(), qw.out_features, y.data_ptr(),
            y.stride(0), bf16, torch.get_num_threads()))

    return cpu_quant.kernel_linear(
        x, qw.in_features, qw.out_features, bias, out,
        (lambda: _fallback(x, qw, bias)) if lib is None else None, launch,
        "int8 (wide activations)" if qw.wide else "w8a8")


def _fallback(x: torch.Tensor, qw: QDotWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Without the kernel: a float32 matmul of the quantized rows and the dequantized
    weights (the kernel's values, summed in another order: float32 rounding apart)."""
    if qw.wide:
        q16, row_scale = quantize_activations16(x)
        stands_for = q16 * row_scale[..., None]
    else:
        stands_for = fake_quantize(x.float(), qw.act_group)
    y = torch.nn.functional.linear(stands_for, dequantize(qw), bias)
    return y.to(x.dtype)
