"""Small C kernels for the CPU path, compiled once per machine and loaded with ctypes.

NOTE: the system C compiler builds each source with `-march=native` (so a build is only
valid on CPUs with the same instruction sets: the cache key holds the CPU's flags), into
~/.cache/loraplex/kernels (`KernelSettings.cache_dir` elsewhere). The sources are the .c
files beside their loaders, with the headers here (`cpu_common.h`, and the `*_typed.h`
each includes once per storage type through `cpu_each_type.h`). The kernels link the
`libgomp.so.1` torch itself loads, so OpenMP regions share torch's thread pool, and
ctypes releases the GIL for every call. Without a compiler, or when a build fails, the
loader returns None and callers keep their torch path. `KernelSettings.enabled` False
(`LORAPLEX_CPU_KERNELS=0`) turns every kernel off (the torch paths then run, for
comparisons).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("loraplex.engine")

# The storage types a kernel built for both (the *_typed.h headers) comes in: torch dtype
# name -> (C type, suffix of the C names).
C_TYPES = {"float32": ("float", "f32"), "bfloat16": ("bf16_t", "bf16")}

# The kernel sources: each loader's .c file here, with the headers beside it.
SOURCE_DIR = Path(__file__).resolve().parent

# NOTE: -fno-trapping-math lets the vectorizer turn a loop's compare-and-select (exp_f32's
# clamps) into blends where there are no masked vector instructions: without it, on an
# AVX2-only CPU, the SiLU loop stayed scalar (4x slower than torch's op at 32 rows). No
# kernel reads the floating-point exception flags. -mprefer-vector-width=512: on AVX-512
# CPUs gcc otherwise vectorizes with 256-bit registers; 512 made SiLU-and-multiply 1.1-1.35x
# and RMSNorm 1.1-1.2x faster on an Intel Xeon with AMX (32 to 2,048 rows). CPUs without
# AVX-512 have no 512-bit vectors and build as before.
FLAGS = (
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno",
    "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
)


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """What the engine says of its kernels (EngineConfig's cpu_kernels, cpu_decode_kernel
    and kernel_cache_dir; each defaults to its environment variable)."""

    enabled: bool = True  # False: every kernel off, the torch paths run (for comparisons)
    decode_attention: bool = True  # the paged decode attention kernel
    prefill_attention: bool = True  # a new bf16 prompt's attention (cpu_attention.py)
    amx: bool = True  # the bf16 AMX kernels: few-row linears, prompt attention on tiles
    gemm: bool = True  # bf16 linear layers on our kernel (cpu_gemm.py) instead of oneDNN
    cache_dir: Path | None = None  # None: ~/.cache/loraplex/kernels


def env_switch(name: str) -> bool:
    """A kernel switch's environment variable: on unless it is "0"."""
    return os.environ.get(name, "1") != "0"


def env_cache_dir() -> Path | None:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE")
    return Path(root) if root else None


def settings_from_env() -> KernelSettings:
    return KernelSettings(
        enabled=env_switch("LORAPLEX_CPU_KERNELS"),
        decode_attention=env_switch("LORAPLEX_CPU_DECODE_KERNEL"),
        prefill_attention=env_switch("LORAPLEX_CPU_PREFILL_KERNEL"),
        amx=env_switch("LORAPLEX_CPU_AMX"),
        gemm=env_switch("LORAPLEX_CPU_GEMM"),
        cache_dir=env_cache_dir(),
    )


# NOTE: process-wide, as the libraries are: the engine sets them when it starts
# (ModelRunner), and a switch turned off is seen by the next kernel call.
_settings = settings_from_env()


def configure(settings: KernelSettings) -> None:
    global _settings
    _settings = settings


def current_settings() -> KernelSettings:
    return _settings


def cache_dir() -> Path:
    root = _settings.cache_dir
    return root if root is not None else Path.home() / ".cache" / "loraplex" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _sources_key(source: Path) -> list[str]:
    """What a build depends on in the source tree: the .c file and the headers beside it
    (the ones it may include)."""
    headers = sorted(source.parent.glob("*.h"))
    return [f"{p.name}\n{p.read_text()}" for p in [source, *headers]]


def build(name: str, source: Path, defines: Mapping[str, object] | None = None
          ) -> ctypes.CDLL | None:
    """The shared library of the C file `source` (its directory on the include path,
    `defines` as -D flags), built (or found in the cache) for this machine."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: the %s kernel stays on the torch path", name)
        return None
    flags = [*FLAGS, f"-I{source.parent}", *(f"-D{k}={v}" for k, v in (defines or {}).items())]
    key = hashlib.sha256(
        "\n".join([*_sources_key(source), compiler, *flags, platform.machine(), _cpu_flags()])
        .encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *flags, str(source), "-o", str(built), "-lm"],
                capture_output=True, text=True, timeout=120, check=False,
            )
            if result.returncode != 0:
                log.warning("the %s kernel did not build: %s", name, result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return ctypes.CDLL(str(target))


class LazyLibrary:
    """Builds a kernel library on first use, once per process; None when unavailable or
    switched off (KernelSettings.enabled, and `switch` of the settings if given)."""

    def __init__(
        self, name: str, source: Path, declare: Callable[[ctypes.CDLL], None],
        *, defines: Mapping[str, object] | None = None,
        switch: Callable[[KernelSettings], bool] | None = None,
    ) -> None:
        self.name, self.source, self.declare = name, source, declare
        self.defines, self.switch = dict(defines or {}), switch
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def _enabled(self) -> bool:
        settings = _settings
        return settings.enabled and (self.switch is None or self.switch(settings))

    def get(self) -> ctypes.CDLL | None:
        if not self._enabled():
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        lib = build(self.name, self.source, self.defines)
                        if lib is not None:
                            self.declare(lib)
                        self._lib = lib
                    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                        log.warning("the %s kernel is unavailable: %s", self.name, exc)
                        self._lib = None
                    self._tried = True
        return self._lib
