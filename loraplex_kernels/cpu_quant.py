"""Weight-only quantized linear layers on the CPU: int8 and int4 weights, float activations.

A `QuantizedWeight` holds integers q with a float32 scale and an optional float32 offset
per group of inputs and output column (w = q * scale + offset), in the block layout of
cpu_quant.c. One layout serves every scheme the engine loads: symmetric int8 per output
channel (group = in_features, no offsets), group-wise asymmetric int4 (RTN on load; what
GPTQ, AWQ and GGUF's Q4_1 store), group-wise int8 (GGUF's Q8_0).

`linear` runs the C kernel: the activations stay float32 or bf16 (weight-only), products
and sums in float32, each group's sum scaled once. Without a compiler it falls back to a
dense matmul over `dequantize`'s weights, the same values up to float32 rounding.

NOTE: torch's own weight-only kernels were measured on the CPUs this runs on and are not
used: `_weight_int8pack_mm` took 42 ms for a 32-row 576 -> 3,072 matmul with float32
activations (no vector path) and 1.5x oneDNN's bf16 time with bf16 ones;
`_weight_int4pack_mm_for_cpu` takes bf16 only. docs/BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary

BLOCK = 16  # output columns per block of the layout
BITS = (8, 4)
QUANTIZE_ROWS = 4096  # rows quantized at a time (quantize_integers)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.quant_linear.argtypes = [ptr, i64, i32, i64, i64, ptr, i32, i64, ptr, ptr, i64, ptr,
                                 ptr, i64, i32, i64]
    lib.quant_linear.restype = ctypes.c_int
    lib.quant_dequantize.argtypes = [ptr, i32, i64, ptr, ptr, i64, i64, ptr, i64]
    lib.quant_dequantize.restype = None


_library = LazyLibrary("quant_linear", SOURCE_DIR / "cpu_quant.c", _declare).get


def available() -> bool:
    """Whether the C kernel is built (else `linear` runs the dense fallback)."""
    return _library() is not None


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as integers, scales and offsets.

    qweight: uint8, the bytes of the block layout (int8 values as their two's complement);
    scales / offsets: float32 [out / 16, in / group, 16] (offsets None: w = q * scale)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        problems = []
        if self.bits not in BITS:
            problems.append(f"{self.bits} bits (8 or 4 are served)")
        if n % BLOCK:
            problems.append(f"{n} output features (a multiple of {BLOCK} is needed)")
        if g <= 0 or k % g or g % 2:
            problems.append(f"group size {g} for {k} input features")
        if not problems:
            groups = (n // BLOCK, k // g, BLOCK)
            if self.qweight.dtype != torch.uint8 or self.qweight.numel() != n * k * self.bits // 8:
                problems.append(f"packed weights {tuple(self.qweight.shape)} "
                                f"{self.qweight.dtype}, expected {n * k * self.bits // 8} bytes")
            for name, t in (("scales", self.scales), ("offsets", self.offsets)):
                if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != groups):
                    problems.append(f"{name} {tuple(t.shape)} {t.dtype}, expected "
                                    f"{groups} float32")
        if problems:
            raise ValueError("quantized weight refused: " + "; ".join(problems))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.offsets) if t is not None)


def _blocked(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, X] -> [N / 16, X, 16] contiguous (columns of a block side by side)."""
    return t.reshape(n // BLOCK, BLOCK, -1).transpose(1, 2).contiguous()


def pack(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
         bits: int, group_size: int) -> QuantizedWeight:
    """Integers q [N, K] (int8 in -128..127, or 0..15 for int4), scales and offsets
    [N, K / group] float -> the kernel's layout."""
    n, k = q.shape
    if bits == 8:
        packed = _blocked(q.to(torch.int8), n).view(torch.uint8)
    else:
        nib = q.to(torch.uint8)
        if bool(((nib > 15) | (q < 0)).any()):
            raise ValueError("int4 values outside 0..15")
        pairs = nib[:, 0::2] | (nib[:, 1::2] << 4)  # [N, K / 2]
        packed = _blocked(pairs, n)
    return QuantizedWeight(
        qweight=packed.reshape(-1),
        scales=_blocked(scales.float(), n),
        offsets=None if offsets is None else _blocked(offsets.float(), n),
        bits=bits, group_size=group_size, out_features=n, in_features=k,
    )


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [N, K] (`quantize_integers`),
    packed."""
    q, scale, offset, group = quantize_integers(weight, bits, group_size)
    return pack(q, scale, offset, bits, group)


def quantize_integers(weight: torch.Tensor, bits: int, group_size: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Round-to-nearest quantization of a float weight [N, K], unpacked: integers [N, K]
    (int8, or uint8 0..15), scales and offsets (or None) [N, K / group] float32, and the
    group size.

    int8: symmetric, one scale per output channel (group_size None) or per group.
    int4: asymmetric per group (a scale and the group's minimum as offset: w = q s + min).

    Rows are quantized QUANTIZE_ROWS at a time, so that the float temporaries of a large
    matrix (an embedding table) stay small."""
    n, k = weight.shape
    group = k if group_size is None else group_size
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide {k} input features")
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not served (8 or 4)")
    # On the weight's device: a GPU quantizes a checkpoint's layers there.
    device = weight.device
    q = torch.empty(n, k, dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
    scales = torch.empty(n, k // group, device=device)
    offsets = None if bits == 8 else torch.empty(n, k // group, device=device)
    for r0 in range(0, n, QUANTIZE_ROWS):
        r1 = min(n, r0 + QUANTIZE_ROWS)
        wg = weight[r0:r1].detach().float().reshape(r1 - r0, k // group, group)
        if bits == 8:
            scale = wg.abs().amax(-1) / 127.0
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            rows = torch.round(wg / scale[..., None]).clamp_(-127, 127)
        else:
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = (hi - lo) / 15.0
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            rows = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15)
            assert offsets is not None
            offsets[r0:r1] = lo
        q[r0:r1] = rows.reshape(r1 - r0, k)
        scales[r0:r1] = scale
    return q, scales, offsets, group


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the integers stand for (a transposed view of a [K, N]
    tensor where the kernel made it: F.linear takes it as it is)."""
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    lib = _library()
    if lib is not None:
        out = torch.empty(k, n, dtype=torch.float32)
        lib.quant_dequantize(qw.qweight.data_ptr(), qw.bits, g, qw.scales.data_ptr(),
                             _ptr(qw.offsets), n, k, out.data_ptr(), torch.get_num_threads())
        return out.t()
    return dequantize_reference(qw)


def dequantize_reference(qw: QuantizedWeight) -> torch.Tensor:
    """`dequantize` in torch ops ([N, K] contiguous): the fallback without a compiler, and
    the layout's definition the kernel is tested against."""
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    blocks = qw.qweight.view(n // BLOCK, -1, BLOCK)
    if qw.bits == 8:
        q = blocks.view(torch.int8).transpose(1, 2).reshape(n, k).float()
    else:
        pairs = blocks.transpose(1, 2).reshape(n, k // 2)
        q = torch.stack([pairs & 15, pairs >> 4], -1).reshape(n, k).float()
    scales = qw.scales.transpose(1, 2).reshape(n, k // g)
    w = q.view(n, k // g, g) * scales[..., None]
    if qw.offsets is not None:
        w = w + qw.offsets.transpose(1, 2).reshape(n, k // g)[..., None]
    return w.reshape(n, k)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32 or bf16 . W^T (+ bias float32 [N]) -> [T, N] in x's dtype (into
    `out` [T, N] when given: rows of any stride, unit stride within a row)."""
    lib = _library()

    def fallback() -> torch.Tensor:
        return torch.nn.functional.linear(
            x, dequantize(qw).to(x.dtype), None if bias is None else bias.to(x.dtype))

    def launch(xc: torch.Tensor, y: torch.Tensor, bf16: int) -> int:
        assert lib is not None
        return int(lib.quant_linear(
            xc.data_ptr(), xc.stride(0), bf16, xc.shape[0], xc.shape[1], qw.qweight.data_ptr(),
            qw.bits, qw.group_size, qw.scales.data_ptr(), _ptr(qw.offsets), qw.out_features,
            _ptr(bias), y.data_ptr(), y.stride(0), bf16, torch.get_num_threads()))

    return kernel_linear(x, qw.in_features, qw.out_features, bias, out,
                         fallback if lib is None else None, launch, "quantized linear")


def kernel_linear(x: torch.Tensor, in_features: int, out_features: int,
                  bias: torch.Tensor | None, out: torch.Tensor | None,
                  fallback: Callable[[], torch.Tensor] | None,
                  launch: Callable[[torch.Tensor, torch.Tensor, int], int],
                  name: str) -> torch.Tensor:
    """What a linear kernel call shares (this module's and cpu_qdot's): the checks, the
    torch `fallback` where there is no kernel (None: there is one), the output (into `out`
    where given), and `launch(x with unit stride, y, bf16)`, which returns non-zero where
    the kernel could not allocate its buffers (MemoryError)."""
    t, k = x.shape
    n = out_features
    assert k == in_features, (x.shape, in_features)
    assert x.dtype in (torch.float32, torch.bfloat16), x.dtype
    if fallback is not None:
        y = fallback()
        if out is None:
            return y
        out.copy_(y)
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(t, n, dtype=x.dtype) if out is None else out
    assert y.shape == (t, n) and y.stride(1) == 1 and y.dtype == x.dtype, (y.shape, y.dtype)
    if t == 0:
        return y
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)
    if launch(x, y, int(x.dtype == torch.bfloat16)):
        raise MemoryError(f"the {name} kernel could not run x {tuple(x.shape)}")
    return y
