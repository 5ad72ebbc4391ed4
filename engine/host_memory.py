"""Host allocator tuning for the CPU path."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("loraplex.engine")

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def keep_freed_activation_memory() -> bool:
    """Stop glibc from handing large freed blocks back to the kernel.

    NOTE: every step allocates the same multi-megabyte activations (a 2,048-token
    prefill makes 25 MB tensors). By default glibc serves those with fresh mmaps and
    unmaps them on free, so each step page-faults all of them in again, about a fifth
    of a long prefill's time on a 2-core machine. Raising the mmap and trim thresholds
    keeps the memory in the heap for reuse; the process keeps its peak step footprint.
    Returns whether the setting was applied (glibc on Linux only).
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES)
    )
    if not ok:
        log.info("mallopt refused the allocator settings; keeping glibc defaults")
    return ok
