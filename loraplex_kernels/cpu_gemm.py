"""bf16 linear layers on the CPU's own bf16 instructions: AMX tiles for steps of up to 32 rows
(a decode step's), or the AVX-512 BF16 dot-product instruction (`vdpbf16ps`, e.g. AMD Zen 4)
for any number of rows. Both variants read the weights in one packed layout (`pack_weight`)
and sum in float32, rounding once to bf16.

At a few dozen rows a linear layer is one read of its weight matrix, each weight used once per
row. The AMX variant reads two weight streams per thread, laid out as the tiles it loads, and
reached 23 GB/s on an Intel Xeon with AMX where oneDNN's packed bf16 matmul read 15.6; larger
steps keep oneDNN there, which is faster (the layer keeps both layouts: see
engine/models/cpu_linear.py). Without AMX, oneDNN's bf16 matmul reaches the CPU's bf16 peak
only from ~128 rows; the dot-product variant reaches it from 8 (docs/BENCHMARKS.md), so it
runs every step and the layer keeps its weights in this layout alone.

NOTE: C in cpu_gemm.c, built by loraplex_kernels/cpu_build.py for the CPU it runs on and
called through ctypes with the GIL released. `available()` is False without AVX-512 BF16 (or a
compiler, or with KernelSettings.gemm off); `uses_tiles()` needs AMX granted by the OS and
KernelSettings.amx on as well.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary, current_settings

DOT_PRODUCT, TILES = 1, 2  # the variant bits of gemm_variants() (cpu_avx512.h bf16_variants)
# The most rows (tokens) the AMX variant takes: two A tiles of 16.
MAX_TILE_ROWS = 32


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.amx_ready.argtypes, lib.amx_ready.restype = [], i32
    lib.gemm_variants.argtypes, lib.gemm_variants.restype = [], i32
    lib.gemm_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
    lib.gemm_bf16.restype = i32


# NOTE: built whatever KernelSettings.gemm says: cpu_attention asks it for the AMX tiles.
_library = LazyLibrary("cpu_gemm", SOURCE_DIR / "cpu_gemm.c", _declare).get


@functools.cache
def _built_variants(lib: ctypes.CDLL) -> int:
    """What the build runs, with AMX only once the OS granted the tiles (asked once per
    library; asking is idempotent)."""
    variants = int(lib.gemm_variants())
    if variants & TILES and not lib.amx_ready():
        variants &= ~TILES
    return variants


def _variants() -> int:
    lib = _library()
    return 0 if lib is None else _built_variants(lib)


def tiles_granted() -> bool:
    """Whether this build has AMX and the OS granted the process its tiles, which must come
    before any tile instruction (cpu_attention's as well): an illegal instruction otherwise.
    KernelSettings.amx on as well."""
    return current_settings().amx and bool(_variants() & TILES)


def available() -> bool:
    """Whether linear runs here (the dot-product variant at least), switched on
    (KernelSettings.gemm)."""
    return current_settings().gemm and bool(_variants() & DOT_PRODUCT)


def uses_tiles() -> bool:
    """Whether linear takes the AMX variant for steps of up to MAX_TILE_ROWS rows."""
    return available() and tiles_granted()


def role() -> str | None:
    """What a bf16 linear layer runs here: "tiles" (steps of up to MAX_TILE_ROWS rows on AMX,
    larger ones on oneDNN), "every_step" (a CPU with AVX-512 BF16 and no AMX: every step on
    the dot-product variant, no oneDNN layout kept) or None (oneDNN alone: no kernel, switched
    off, or AMX switched off where the CPU has it, which leaves oneDNN's AMX matmuls)."""
    if not available():
        return None
    if _variants() & TILES:
        return "tiles" if current_settings().amx else None
    return "every_step"


def fits(out_features: int, in_features: int) -> bool:
    """Whether a [out_features, in_features] weight has the kernel's shape."""
    return out_features % 32 == 0 and in_features % 32 == 0 and out_features * in_features > 0


def silu_mul_fits(out_features: int) -> bool:
    """Whether linear_silu_mul takes a gate_up weight of this many rows."""
    return out_features % 64 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bfloat16 -> the kernels' layout: for each block of 16 output columns, for
    each 32 inputs, a 1 KiB tile of 16 rows (input pairs) by 16 columns by 2."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and fits(n, k), (weight.dtype, weight.shape)
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_weight's inverse: W [N, K]."""
    n = out_features
    k = packed.numel() // n
    return packed.view(n // 16, k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, *, tiles: bool | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (M >= 1, unit stride within rows) . W^T + bias -> new [M, N], W
    packed by pack_weight; summed in float32 and rounded once. tiles: None takes the AMX
    variant where uses_tiles() and M <= MAX_TILE_ROWS; False forces the dot-product one."""
    return _gemm(x, packed, out_features, out_features, bias, tiles, silu_mul=False)


def linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None, *, tiles: bool | None = None,
                    ) -> torch.Tensor:
    """A fused gate_up projection (W: the gate rows, then as many up rows) and its SiLU:
    new [M, N / 2], equal bit for bit to cpu_ops.silu_mul(linear(x, ...)) without the
    [M, N] product in between. N a multiple of 64 (silu_mul_fits)."""
    assert silu_mul_fits(out_features), out_features
    return _gemm(x, packed, out_features, out_features // 2, bias, tiles, silu_mul=True)


def _gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int, out_columns: int,
          bias: torch.Tensor | None, tiles: bool | None, *, silu_mul: bool) -> torch.Tensor:
    lib = _library()
    assert lib is not None and available(), "the bf16 linear kernel is not available"
    m, k = x.shape
    use_tiles = uses_tiles() and m <= MAX_TILE_ROWS if tiles is None else tiles
    assert not use_tiles or (uses_tiles() and m <= MAX_TILE_ROWS), (
        "the AMX variant is not available here or takes at most 32 rows", m)
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and m >= 1, (
        x.dtype, x.shape, x.stride())
    assert packed.numel() == out_features * k, (packed.shape, out_features, k)
    if bias is not None:
        assert bias.dtype == torch.bfloat16 and bias.is_contiguous()
        assert bias.shape == (out_features,)
    y = torch.empty(m, out_columns, dtype=torch.bfloat16)
    failed = lib.gemm_bf16(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
        int(silu_mul), int(use_tiles),
    )
    if failed:
        raise ValueError(f"the bf16 linear kernel refused x {tuple(x.shape)}, "
                         f"{out_features} outputs")
    return y
