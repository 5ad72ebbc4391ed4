"""Small C kernels for the CPU path, compiled once per machine and loaded with ctypes.

NOTE: the system C compiler builds each source with `-march=native` (so a build is only
valid on CPUs with the same instruction sets: the cache key holds the CPU's flags), into
~/.cache/loraplex/kernels (`LORAPLEX_KERNEL_CACHE` elsewhere). The kernels link the
`libgomp.so.1` torch itself loads, so OpenMP regions share torch's thread pool, and
ctypes releases the GIL for every call. Without a compiler, or when a build fails, the
loader returns None and callers keep their torch path. `LORAPLEX_CPU_KERNELS=0` turns
every kernel off (the torch paths then run, for comparisons).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("loraplex.engine")

# C the kernels share: the dot product in 8 independent lanes, vectorized without
# reassociating a sum (so a build's results do not depend on the compiler's choices).
C_DOT = r"""
#include <stdint.h>

static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const float *restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[d + k] * b[d + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}
"""

# bfloat16 storage for the kernels that come in both dtypes (see `instantiate`): values
# are read into float32, computed in float32 and rounded to nearest even when stored,
# as torch rounds (a NaN stays a quiet NaN).
C_BF16 = r"""
#include <stdint.h>

typedef uint16_t bf16_t;

static inline __attribute__((always_inline)) float ld_f32(float v) { return v; }
static inline __attribute__((always_inline)) float st_f32(float v) { return v; }

static inline __attribute__((always_inline)) float ld_bf16(bf16_t v) {
    const union { uint32_t i; float f; } u = {.i = (uint32_t)v << 16};
    return u.f;
}

static inline __attribute__((always_inline)) bf16_t st_bf16(float v) {
    const union { float f; uint32_t i; } u = {.f = v};
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u.i >> 16) | 0x40u);
    return (bf16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

/* The dot product of two bf16 rows in float32: on AVX-512 BF16, pairs of products summed
   by the dot-product unit (each product exact, the sums rounded to nearest); elsewhere in
   16 lanes, as dot() (no reassociation left to the compiler). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) float dot_bf16(const bf16_t *restrict a,
                                                            const bf16_t *restrict b,
                                                            int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= n; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d),
                               (__m512bh)_mm512_loadu_si512(b + d));
    float s = _mm512_reduce_add_ps(acc);
    for (; d < n; d++) s += ld_bf16(a[d]) * ld_bf16(b[d]);
    return s;
}
#else
static inline __attribute__((always_inline)) float dot_bf16(const bf16_t *restrict a,
                                                            const bf16_t *restrict b,
                                                            int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int k = 0; k < 16; k++) acc[k] += ld_bf16(a[d + k]) * ld_bf16(b[d + k]);
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += ld_bf16(a[d]) * ld_bf16(b[d]);
    return s;
}
#endif

static inline __attribute__((always_inline)) float dot_f32(const float *restrict a,
                                                           const float *restrict b, int64_t n) {
    return dot(a, b, n);
}
"""

# The storage types a templated kernel is built for: torch dtype name -> (C type, suffix).
C_TYPES = {"float32": ("float", "f32"), "bfloat16": ("bf16_t", "bf16")}


def instantiate(template: str, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> str:
    """One copy of `template` per dtype: `scalar_t` becomes its C type and every `@` its
    suffix (so `rms_norm_@` is `rms_norm_f32` and `rms_norm_bf16`, `ld_@` the matching
    load and `st_@` the matching store)."""
    return "".join(
        template.replace("scalar_t", C_TYPES[d][0]).replace("@", C_TYPES[d][1]) for d in dtypes
    )


# e^x for the kernels' vector loops (libm's expf keeps a loop scalar without -ffast-math).
C_EXP = r"""
/* e^x to a few float32 ulps, in plain C that vectorizes: x = n ln2 + r, |r| <= ln2 / 2,
   e^r by Cephes' polynomial, 2^n by the exponent bits. x is clamped to [-87.3, 88.3] so
   that 2^n stays normal (e^x below e^-87.3 is 0 to what callers can tell). */
static inline __attribute__((always_inline)) float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    /* round to nearest by the 1.5 * 2^23 trick: floorf would keep the loop scalar */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * (r * r) + r + 1.0f;
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return er * scale.f;
}
"""

# NOTE: -fno-trapping-math lets the vectorizer turn a loop's compare-and-select (exp_f32's
# clamps) into blends where there are no masked vector instructions: without it, on an
# AVX2-only CPU, the SiLU loop stayed scalar (4x slower than torch's op at 32 rows). No
# kernel reads the floating-point exception flags.
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared",
    "-fPIC",
)


def cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loraplex" / "kernels"


def kernels_enabled() -> bool:
    return os.environ.get("LORAPLEX_CPU_KERNELS", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build(name: str, source: str) -> ctypes.CDLL | None:
    """The shared library of `source`, built (or found in the cache) for this machine."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: the %s kernel stays on the torch path", name)
        return None
    key = hashlib.sha256(
        "\n".join([source, compiler, *FLAGS, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, str(src), "-o", str(built), "-lm"],
                capture_output=True, text=True, timeout=120, check=False,
            )
            if result.returncode != 0:
                log.warning("the %s kernel did not build: %s", name, result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return ctypes.CDLL(str(target))


class LazyLibrary:
    """Builds a kernel library on first use, once per process; None when unavailable."""

    def __init__(
        self, name: str, source: str, declare: Callable[[ctypes.CDLL], None],
        *, env_switch: str | None = None,
    ) -> None:
        self.name, self.source, self.declare, self.env_switch = name, source, declare, env_switch
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def _enabled(self) -> bool:
        if not kernels_enabled():
            return False
        return self.env_switch is None or os.environ.get(self.env_switch, "1") != "0"

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    if self._enabled():
                        try:
                            lib = build(self.name, self.source)
                            if lib is not None:
                                self.declare(lib)
                            self._lib = lib
                        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                            log.warning("the %s kernel is unavailable: %s", self.name, exc)
                            self._lib = None
                    self._tried = True
        return self._lib
