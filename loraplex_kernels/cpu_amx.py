"""bf16 on AMX tiles: linear layers of up to 32 rows (the matmuls of a decode step). A new
prompt's causal attention runs on the tiles too, in loraplex_kernels/cpu_attention.py.

At a few dozen rows a linear layer's time is the read of its weight matrix: each weight
is used once per row. This kernel reads two weight streams per thread, laid out as the
tiles it loads (`pack_weight`), and reached 23 GB/s on an Intel Xeon with AMX where
oneDNN's packed bf16 matmul read 15.6 (docs/BENCHMARKS.md). Larger steps (prefill) keep
oneDNN, which is faster there: the layer keeps both layouts (see
engine/models/cpu_linear.py).

NOTE: C in cpu_amx.c, built by loraplex_kernels/cpu_build.py for the CPU it runs on and
called through ctypes with the GIL released. Without AMX (or a compiler, or when the
kernel is switched off: KernelSettings.amx), `available()` is False.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary

# The most rows (tokens) the kernel takes: two A tiles of 16.
MAX_ROWS = 32


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_ready.argtypes, lib.amx_ready.restype = [], ctypes.c_int
    lib.amx_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
    lib.amx_linear_bf16.restype = ctypes.c_int
    lib.amx_linear_silu_mul_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
    lib.amx_linear_silu_mul_bf16.restype = ctypes.c_int


_library = LazyLibrary(
    "cpu_amx", SOURCE_DIR / "cpu_amx.c", _declare, switch=lambda settings: settings.amx
).get


@functools.cache
def _tiles_granted(lib: ctypes.CDLL) -> bool:
    """Built with AMX and the tiles granted by the OS (asked once; asking is idempotent)."""
    return bool(lib.amx_ready())


def available() -> bool:
    """Whether the kernels run here: built with AMX, the tiles granted by the OS, and
    switched on (KernelSettings.amx)."""
    lib = _library()
    return lib is not None and _tiles_granted(lib)


def _granted_library() -> ctypes.CDLL:
    # NOTE: available() asks the OS for the tiles; a tile instruction before that is an
    # illegal instruction.
    lib = _library()
    assert lib is not None and _tiles_granted(lib), (
        "the AMX kernels are not available: check available() first")
    return lib


def fits(out_features: int, in_features: int) -> bool:
    """Whether a [out_features, in_features] weight has the kernel's shape."""
    return out_features % 32 == 0 and in_features % 32 == 0 and out_features * in_features > 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bfloat16 -> the kernel's layout: for each block of 16 output columns, for
    each 32 inputs, a 1 KiB tile of 16 rows (input pairs) by 16 columns by 2."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and fits(n, k), (weight.dtype, weight.shape)
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (1 <= M <= MAX_ROWS, unit stride within rows) . W^T + bias ->
    new [M, N], W packed by pack_weight; summed in float32 and rounded once."""
    return _linear("amx_linear_bf16", x, packed, out_features, out_features, bias)


def linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """A fused gate_up projection (W: the gate rows, then as many up rows) and its SiLU:
    new [M, N / 2], equal bit for bit to cpu_ops.silu_mul(linear(x, ...)) without the
    [M, N] product in between. N a multiple of 64 (silu_mul_fits)."""
    assert silu_mul_fits(out_features), out_features
    return _linear("amx_linear_silu_mul_bf16", x, packed, out_features, out_features // 2, bias)


def silu_mul_fits(out_features: int) -> bool:
    """Whether linear_silu_mul takes a gate_up weight of this many rows."""
    return out_features % 64 == 0


def _linear(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int,
            out_columns: int, bias: torch.Tensor | None) -> torch.Tensor:
    lib = _granted_library()
    m, k = x.shape
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and 1 <= m <= MAX_ROWS, (
        x.dtype, x.shape, x.stride())
    assert packed.numel() == out_features * k, (packed.shape, out_features, k)
    if bias is not None:
        assert bias.dtype == torch.bfloat16 and bias.is_contiguous()
        assert bias.shape == (out_features,)
    y = torch.empty(m, out_columns, dtype=torch.bfloat16)
    failed = getattr(lib, kernel)(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"the AMX linear kernel refused x {tuple(x.shape)}, "
                         f"{out_features} outputs")
    return y
