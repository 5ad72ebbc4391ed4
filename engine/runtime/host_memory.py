"""Host allocator tuning for the CPU path."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("loraplex.engine")

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP_BYTES = 1 << 30


@functools.cache  # looked up once: find_library runs ldconfig
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the pages of every free heap chunk back to the kernel (glibc malloc_trim).

    NOTE: loading weights and packing them for oneDNN frees about a model's size of
    unpacked tensors and conversion buffers; glibc keeps such memory mapped (in the
    middle of the heap, or below the raised trim threshold) for later mallocs, so without
    this the process keeps them in its RSS for good. Returns whether it ran.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def keep_freed_activation_memory() -> bool:
    """Stop glibc from handing large freed blocks back to the kernel.

    NOTE: every step allocates the same multi-megabyte activations (a 2,048-token
    prefill makes 25 MB tensors). By default glibc serves those with fresh mmaps and
    unmaps them on free, so each step page-faults all of them in again, about a fifth
    of a long prefill's time on a 2-core machine. Raising the mmap and trim thresholds
    keeps the memory in the heap for reuse; the process keeps its peak step footprint.
    Returns whether the setting was applied (glibc on Linux only).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES)
    )
    if not ok:
        log.info("mallopt refused the allocator settings; keeping glibc defaults")
    return ok


def share_one_heap() -> bool:
    """Have every thread created from now on allocate from the main heap (one arena).

    NOTE: glibc gives threads heaps of their own (up to eight per core), each at most
    64 MiB and unmapped again as soon as it is empty. The engine steps on a thread of its
    own, and a step frees everything it allocated: a prefill step's activations then
    land in fresh heaps that are unmapped at its end, and every step page-faults them in
    again. Measured over a 32-request burst stepped on a thread: 310-380 thousand page
    faults against 130-140 thousand on the main heap, the prefill steps ~5% slower. Call
    it before the step thread starts, best before any thread is started (a thread that
    already has a heap keeps it). Returns whether it applied (glibc on Linux only).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, 1))


# A quiet spell this long after a step ends a burst: the freed heap goes back then.
IDLE_TRIM_S = 2.0


class IdleTrimmer:
    """Runs release_free_memory once no step has run for `idle_s` seconds.

    NOTE: keep_freed_activation_memory keeps a step's freed activations in the heap so the
    next step reuses them without page faults; after a burst that is the peak step
    footprint, held for good. Trimming only after a quiet spell keeps steps fast while
    busy and gives the memory back when idle. One thread per process, started with the
    first step: the heap is the process's.
    """

    def __init__(self, idle_s: float = IDLE_TRIM_S) -> None:
        self.idle_s = idle_s
        self.num_trims = 0
        self._cond = threading.Condition()
        self._busy = 0  # steps running now
        self._last_step = 0.0  # when the last step ended
        self._pending = False  # a step ran since the last trim
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a step: no trim while it runs; the quiet spell starts when it ends."""
        with self._cond:
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="loraplex-idle-trim", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._last_step = time.monotonic()
                self._pending = True
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending or self._busy:
                    self._cond.wait()
                wait = self._last_step + self.idle_s - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._pending = False
            release_free_memory()
            self.num_trims += 1


idle_trimmer = IdleTrimmer()
