"""bf16 causal attention of a new prompt (nothing cached before it) on the CPU: on AMX tiles
where the CPU has them (and `cpu_gemm` has them granted), else on the AVX-512 BF16 dot-product
instruction (`vdpbf16ps`, e.g. AMD Zen 4).

torch's CPU flash kernel runs bf16 at float32's pace or slower on these CPUs: over a
2,048-token prefill step's prompts of 20-400 tokens it took about a quarter of the step on a
Zen 4 (docs/BENCHMARKS.md). Both variants lay K^T and V out in bf16 pairs once per call and
keep torch's rounding of the probabilities to bf16 before their product with V, so their
results stay within what torch's own kernel differs by from exact attention.

NOTE: C in cpu_attention.c, built by loraplex_kernels/cpu_build.py for the CPU it runs on
and called through ctypes with the GIL released. Without AVX-512 BF16 (or a compiler, or
with the kernel switched off: KernelSettings.prefill_attention), `available()` is False
and callers keep torch's kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex_kernels import cpu_gemm
from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary
from loraplex_kernels.cpu_gemm import DOT_PRODUCT, TILES  # the variant bits both report


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.causal_attention_variants.argtypes, lib.causal_attention_variants.restype = (
        [], ctypes.c_int)
    lib.causal_attention_bf16.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64,
                                          i64, ctypes.c_float, ptr, i64, i64]
    lib.causal_attention_bf16.restype = ctypes.c_int


_library = LazyLibrary(
    "cpu_attention", SOURCE_DIR / "cpu_attention.c", _declare,
    switch=lambda settings: settings.prefill_attention,
).get


def _variants() -> int:
    lib = _library()
    return 0 if lib is None else _built_variants(lib)


@functools.cache
def _built_variants(lib: ctypes.CDLL) -> int:
    """What the build runs (fixed per library: asked once, not per prompt and layer)."""
    return int(lib.causal_attention_variants())


def uses_tiles() -> bool:
    """Whether causal_attention runs on AMX tiles here: built with them, and cpu_gemm has the
    tiles granted and switched on."""
    return bool(_variants() & TILES) and cpu_gemm.tiles_granted()


def available() -> bool:
    """Whether causal_attention runs here (either variant)."""
    return bool(_variants() & DOT_PRODUCT)


def fits(head_dim: int) -> bool:
    """Whether causal_attention takes heads of this size."""
    return head_dim % 32 == 0 and 0 < head_dim <= 256


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float, *, tiles: bool | None = None) -> torch.Tensor:
    """`reference.causal_attention` in bf16: query [L, H, D], key and value [L, KVH, D]
    (heads and D contiguous, rows any stride apart) -> new [L, H, D]. tiles: None picks
    AMX tiles where uses_tiles(); False forces the dot-product variant (tests)."""
    lib = _library()
    assert lib is not None and available(), "the prompt attention kernel is not available"
    use_tiles = uses_tiles() if tiles is None else tiles
    assert not use_tiles or uses_tiles(), "AMX tiles are not available here"
    length, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    for t in (query, key, value):
        assert t.dtype == torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == head_dim
    assert key.shape == value.shape == (length, kv_heads, head_dim), (key.shape, value.shape)
    assert fits(head_dim) and heads % kv_heads == 0
    out = torch.empty(length, heads, head_dim, dtype=torch.bfloat16)
    padded = -(-length // 32) * 32
    work = torch.empty(2 * kv_heads * padded * head_dim, dtype=torch.bfloat16)
    failed = lib.causal_attention_bf16(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
        value.stride(0), out.data_ptr(), length, heads, kv_heads, head_dim, scale,
        work.data_ptr(), torch.get_num_threads(), int(use_tiles),
    )
    if failed:
        raise ValueError(f"the prompt attention kernel refused {tuple(query.shape)}")
    return out
