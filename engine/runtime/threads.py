"""Torch work off the step thread: on one core, so that the step keeps its OpenMP team fast.

NOTE: with OpenMP (torch's CPU build), every thread that starts a parallel region gets a
team of worker threads of its own, kept for the thread's life. Once a process holds more
such threads than there are cores, libgomp "throttles": its idle workers stop spinning
between parallel regions and sleep at once, so each of the hundreds of small ops in a
decode step waits for its team to be woken. On a 2-core machine one extra team (from
loading an adapter on an executor thread, say) made 32-row matmuls 10-15% and an
elementwise op 20-30% slower on the step thread. So the step thread builds the model
(engine/async_engine.py), and the other threads that touch tensors (adapter reads and
checks, the adapter cache's loads) run their ops on the calling thread alone.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

log = logging.getLogger("loraplex.engine")

_local = threading.local()


@functools.cache
def _omp_setter() -> Callable[[int], None] | None:
    """libgomp's omp_set_num_threads, from the copy torch loaded; None without one."""
    try:
        # NOTE: by soname, so the library torch already loaded is the one found.
        setter = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        log.info("no libgomp: off-step torch work keeps torch's thread count")
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], None
    return setter


def use_one_intraop_thread() -> bool:
    """Make torch ops called from this thread run on this thread only (no OpenMP team).
    Idempotent; the step thread must never call it. Returns whether it applied."""
    if getattr(_local, "single", False):
        return True
    setter = _omp_setter()
    if setter is None:
        return False
    # torch sets each thread's OpenMP thread count on its first use in that thread (to
    # torch.get_num_threads() of the process); have that happen first, then override it
    # for this thread alone.
    torch.get_num_threads()
    setter(1)
    _local.single = True
    return True


def on_passing_thread(work: Callable[[], T], *, name: str = "loraplex-passing") -> T:
    """Run `work` on a thread of its own that ends with it; return or raise what it did.
    For heavy torch work before serving (training the demo's adapters, say): the OpenMP
    team it starts goes away with its thread, instead of staying with the caller's."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:
            done.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)  # Ctrl-C need not wait
    thread.start()
    thread.join()
    return done.result()


def single_core_executor(max_workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads run torch ops on one core each."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=name, initializer=use_one_intraop_thread
    )
