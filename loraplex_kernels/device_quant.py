"""Quantized linear layers on CUDA: int8 and int4 weight-only, and fp8.

The CPU has its own layouts and C kernels (cpu_quant.py, cpu_qdot.py); on a GPU the
weights are held in plain row-major tensors that torch and Triton read directly:

- DeviceQuantizedWeight (int8, int4): q [N, K] int8 (int4: [N, K / 2] uint8, input k in
  the low nibble of byte k / 2 for even k, the high one for odd k, values 0..15), scales
  and offsets [N, K / group] float32: w = q * scale (+ offset), the CPU's arithmetic.
  Steps of up to KERNEL_ROWS rows (decode) run triton_quant's kernel, which reads the
  integers and dequantizes each tile as it multiplies: a decode step reads a quarter (int4)
  or half (int8) of bf16's bytes. Larger steps are bound by arithmetic, not by reading
  weights: the layer is dequantized to the activations' dtype and multiplied by cuBLAS.
- Fp8Weight: float8_e4m3fn [N, K] with a float32 scale per output channel; each row of
  the activations quantized to fp8 with its own scale (max |x| / 448) as the step runs,
  multiplied by torch._scaled_mm (the fp8 tensor cores of compute capability 8.9 and
  newer) with float32 output, then both scales applied. Per row rather than per tensor:
  a row's result never depends on which other requests share its step.

`linear` is the entry point. Without CUDA (the tests) the same computation runs in torch
ops; `reference_linear` is its definition in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# Rows up to which a step runs the Triton kernel on CUDA; above, dequantize and cuBLAS.
KERNEL_ROWS = 64
# Weights dequantize() converts at a time (float32 temporaries of 64 MiB).
DEQUANTIZE_ELEMENTS = 1 << 24
# The kernel's K tile: a divisor of the group size among these (tl.dot needs >= 16).
KERNEL_BLOCK_K = (64, 32, 16)


@dataclass(frozen=True, slots=True)
class DeviceQuantizedWeight:
    """A [out_features, in_features] int8 or int4 weight, row-major (the module's doc)."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        problems = []
        if self.bits not in (8, 4):
            problems.append(f"{self.bits} bits (8 or 4 are served)")
        if g <= 0 or k % g or (self.bits == 4 and g % 2):
            problems.append(f"group size {g} for {k} input features")
        if not problems:
            want = (n, k) if self.bits == 8 else (n, k // 2)
            dtype = torch.int8 if self.bits == 8 else torch.uint8
            if self.q.dtype != dtype or tuple(self.q.shape) != want:
                problems.append(f"integers {tuple(self.q.shape)} {self.q.dtype}, expected "
                                f"{want} {dtype}")
            for name, t in (("scales", self.scales), ("offsets", self.offsets)):
                if t is not None and (t.dtype != torch.float32
                                      or tuple(t.shape) != (n, k // g)):
                    problems.append(f"{name} {tuple(t.shape)} {t.dtype}, expected "
                                    f"{(n, k // g)} float32")
        if problems:
            raise ValueError("quantized weight refused: " + "; ".join(problems))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.scales, self.offsets) if t is not None)

    @property
    def kernel_block_k(self) -> int | None:
        """The kernel's K tile for this weight, None where no tile fits a group (the
        dense path serves every step)."""
        for block in KERNEL_BLOCK_K:
            if self.group_size % block == 0:
                return block
        return None


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A [out_features, in_features] weight as float8_e4m3fn with a float32 scale per
    output channel: w = q * scales[n]."""

    q: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        problems = []
        if self.q.dtype != FP8_DTYPE or tuple(self.q.shape) != (n, k):
            problems.append(f"weights {tuple(self.q.shape)} {self.q.dtype}, expected "
                            f"{(n, k)} {FP8_DTYPE}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (n,):
            problems.append(f"scales {tuple(self.scales.shape)} {self.scales.dtype}, "
                            f"expected ({n},) float32")
        if n % 16 or k % 16:
            problems.append(f"[{n}, {k}]: fp8 matmuls need multiples of 16")
        if problems:
            raise ValueError("fp8 weight refused: " + "; ".join(problems))

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4

    @property
    def bits(self) -> int:
        return 8

    @property
    def group_size(self) -> int:
        return self.in_features


def pack(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
         group_size: int, device: torch.device | str) -> DeviceQuantizedWeight:
    """Integers q [N, K] (int8 in -128..127, or 0..15 for int4), scales and offsets
    [N, K / group] -> a DeviceQuantizedWeight on `device`."""
    n, k = q.shape
    if bits == 8:
        stored = q.to(torch.int8)
    else:
        if bool(((q < 0) | (q > 15)).any()):
            raise ValueError("int4 values outside 0..15")
        if k % 2:
            raise ValueError(f"{k} input features (int4 needs an even number)")
        nib = q.to(torch.uint8)
        stored = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return DeviceQuantizedWeight(
        q=stored.contiguous().to(device),
        scales=scales.float().contiguous().to(device),
        offsets=None if offsets is None else offsets.float().contiguous().to(device),
        bits=bits, group_size=group_size, out_features=n, in_features=k)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as float8_e4m3fn (round to nearest even, per output channel
    scale max |w| / 448) and its scales [N] float32, on the weight's device."""
    w = weight.detach().float()
    scales = w.abs().amax(-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def pack_fp8(q: torch.Tensor, scales: torch.Tensor, device: torch.device | str) -> Fp8Weight:
    """fp8 values [N, K] and per-channel scales ([N] or [N, 1]) -> an Fp8Weight on
    `device`."""
    n, k = q.shape
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 weights must be {FP8_DTYPE}, got {q.dtype}")
    return Fp8Weight(q=q.contiguous().to(device),
                     scales=scales.float().reshape(n).contiguous().to(device),
                     out_features=n, in_features=k)


def unpack_integers(qw: DeviceQuantizedWeight) -> torch.Tensor:
    """The integers [N, K] (int8, or uint8 0..15)."""
    return _unpack_rows(qw.q, qw.bits)


def _unpack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of stored integers -> [rows, K]: int8 as they are, int4's nibbles (the low one
    the even input) side by side."""
    if bits == 8:
        return q
    return torch.stack([q & 15, q >> 4], -1).reshape(q.shape[0], -1)


def dequantize(qw: DeviceQuantizedWeight | Fp8Weight,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the values stand for, computed in float32, in `dtype`: a
    DEQUANTIZE_ELEMENTS block of rows at a time, so that the float32 temporaries of a large
    layer (a fused gate_up) stay small beside the result."""
    n, k = qw.out_features, qw.in_features
    out = torch.empty(n, k, dtype=dtype, device=qw.scales.device)
    step = max(1, DEQUANTIZE_ELEMENTS // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if isinstance(qw, Fp8Weight):
            w = qw.q[r0:r1].float().mul_(qw.scales[r0:r1, None])
        else:
            g = qw.group_size
            q = _unpack_rows(qw.q[r0:r1], qw.bits)
            w = q.reshape(r1 - r0, k // g, g).float().mul_(qw.scales[r0:r1, :, None])
            if qw.offsets is not None:
                w.add_(qw.offsets[r0:r1, :, None])
        out[r0:r1] = w.view(r1 - r0, k)
    return out


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [T, K] as float8_e4m3fn, each with its scale max |x| / 448 ([T, 1]
    float32; rows of zeros get 1). A row holding a NaN or an infinity gets a NaN scale, so
    its outputs come out NaN as a float product's would."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    q = (xf / scale).nan_to_num_(0.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fake_quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """What fp8 activations stand for: each row as Fp8Weight's linear quantizes it, back
    in x's dtype (a Hugging Face oracle's pre-hook)."""
    shape = x.shape
    q, scale = quantize_rows_fp8(x.reshape(-1, shape[-1]))
    return (q.float() * scale).reshape(shape).to(x.dtype)


def linear(x: torch.Tensor, qw: DeviceQuantizedWeight | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [T, K] in float32, bf16 or fp16: [T, N] in x's dtype. bias:
    float32 [N] or None."""
    if isinstance(qw, Fp8Weight):
        return _fp8_linear(x, qw, bias)
    if x.is_cuda and x.shape[0] <= KERNEL_ROWS and qw.kernel_block_k is not None:
        from loraplex_kernels import triton_quant

        return triton_quant.quant_linear(x, qw, bias)
    y = torch.nn.functional.linear(x, dequantize(qw, x.dtype))
    if bias is not None:
        y = (y.float() + bias).to(x.dtype)
    return y


def _fp8_linear(x: torch.Tensor, qw: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    xq, xs = quantize_rows_fp8(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    # Unit scales and float32 output, then both scales (in place): the per-row scaling
    # every _scaled_mm backend supports, with the same rounding everywhere.
    y = torch._scaled_mm(xq.contiguous(), qw.q.t(), scale_a=one, scale_b=one,
                         out_dtype=torch.float32)
    y.mul_(xs).mul_(qw.scales)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype)


def reference_linear(x: torch.Tensor, qw: DeviceQuantizedWeight | Fp8Weight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear`'s definition in float64 (what the kernels are tested against): the weight
    as `dequantize` makes it in x's dtype; fp8 activations as `fake_quantize_fp8`."""
    if isinstance(qw, Fp8Weight):
        xq, xs = quantize_rows_fp8(x)
        y = (xq.double() @ qw.q.double().t()) * xs.double() * qw.scales.double()
    else:
        y = x.double() @ dequantize(qw, x.dtype).double().t()
    if bias is not None:
        y = y + bias.double()
    return y
