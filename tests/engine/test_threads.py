"""Threads and the CPU: the step thread is the process's only OpenMP team, and the step
thread allocates from the main heap (engine/runtime/threads.py, engine/runtime/host_memory.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import async_engine
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.lora.weights import LoRAWeights
from engine.models.loader import ModelLoadError
from engine.runtime.threads import on_passing_thread, single_core_executor, use_one_intraop_thread
from tests.utils.peft_adapters import make_peft_adapter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The process's intra-op threads at 2 (as on a 2-core machine), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_intraop_thread_is_for_the_calling_thread_only(two_threads: None) -> None:
    def confined() -> tuple[int, int, bool]:
        before = torch.get_num_threads()
        applied = use_one_intraop_thread()
        assert use_one_intraop_thread()  # again: nothing changes
        return before, torch.get_num_threads(), applied

    assert on_passing_thread(confined) == (2, 1, True)
    assert torch.get_num_threads() == 2
    assert on_passing_thread(torch.get_num_threads) == 2  # a later thread is not confined


def test_a_single_core_executor_runs_torch_on_its_own_thread(two_threads: None) -> None:
    with single_core_executor(2, "test-single") as pool:
        counts = list(pool.map(lambda _: torch.get_num_threads(), range(8)))
        # Real work still runs there, and right.
        total = pool.submit(lambda: torch.ones(1 << 20).sum().item()).result()
    assert counts == [1] * 8
    assert total == float(1 << 20)
    assert torch.get_num_threads() == 2


def test_on_passing_thread_returns_raises_and_leaves_no_thread() -> None:
    names: list[str] = []

    def work() -> int:
        names.append(threading.current_thread().name)
        return 7

    assert on_passing_thread(work, name="test-pass") == 7
    assert names == ["test-pass"]
    assert not any(t.name == "test-pass" for t in threading.enumerate())
    with pytest.raises(ZeroDivisionError):
        on_passing_thread(lambda: 1 // 0)


# A fresh interpreter (Linux: /proc): its threads counted before and after torch work on a
# thread that ends (its OpenMP team goes with it) and on one that stays (its team stays).
_TEAMS = """
import os, sys, threading, torch
from engine.runtime.threads import on_passing_thread
torch.set_num_threads(2)
def tasks(): return len(os.listdir("/proc/self/task"))
def work(): torch.randn(2048, 2048).exp_().sum()
import time
start = tasks()
on_passing_thread(work)
for _ in range(200):  # the team's threads end just after the thread that started it
    if tasks() == start:
        break
    time.sleep(0.01)
after_passing = tasks()
stay = threading.Event()
def stays(): work(); stay.wait()
t = threading.Thread(target=stays); t.start()
time.sleep(0.5)
print(start, after_passing, tasks())
stay.set(); t.join()
"""


def test_torch_work_on_a_passing_thread_leaves_no_openmp_team() -> None:
    out = subprocess.run([sys.executable, "-c", _TEAMS], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    start, after_passing, with_staying = map(int, out.stdout.split())
    assert after_passing == start
    # The staying thread and at least one OpenMP worker of its own.
    assert with_staying >= start + 2


# A fresh interpreter (glibc): page faults of a thread that allocates, touches and frees four
# 40 MiB buffers, three times over, on the main heap (`one`) or on a heap of its own.
_HEAP = """
import ctypes, resource, sys, threading
from engine.runtime.host_memory import keep_freed_activation_memory, share_one_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert keep_freed_activation_memory()
if sys.argv[1] == "one":
    assert share_one_heap()
SIZE = 40 << 20
faults = []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        ptrs = [libc.malloc(SIZE) for _ in range(4)]
        for p in ptrs:
            ctypes.memset(p, 1, SIZE)
        for p in ptrs:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=rounds); t.start(); t.join()
print(*faults)
"""


def _heap_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _HEAP, mode], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    return [int(x) for x in out.stdout.split()]


def test_a_thread_on_the_main_heap_reuses_what_it_freed() -> None:
    pages = 4 * (40 << 20) // os.sysconf("SC_PAGE_SIZE")
    own = _heap_faults("own")
    one = _heap_faults("one")
    assert own[0] >= pages * 0.9 and one[0] >= pages * 0.9  # first touch, both
    # A heap of its own: each 64 MiB heap the thread needed is unmapped once empty, so
    # later rounds fault again; on the main heap the freed memory is reused.
    assert min(own[1:]) >= pages // 8
    assert max(one[1:]) < pages // 100


def test_the_engine_loads_on_its_step_thread_and_reads_adapters_on_one_core(
    tiny_model_factory: Callable[[str], Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    adapter = make_peft_adapter(model_dir, tmp_path / "a", seed=3)
    seen: dict[str, Any] = {}

    class Recording(EngineCore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen["built_on"] = threading.current_thread().name
            super().__init__(*args, **kwargs)

        def load_adapter(self, name: str, path: str | Path) -> LoRAWeights:
            seen["read_on"] = (threading.current_thread().name, torch.get_num_threads())
            return super().load_adapter(name, path)

    monkeypatch.setattr(async_engine, "EngineCore", Recording)
    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_tokens=1024,
                                      max_model_len=128))

    async def scenario() -> None:
        await engine.start()
        try:
            assert engine.is_ready()
            info = await engine.add_adapter("a", str(adapter))
            assert info.name == "a"
            # The adapter cache's loads (a version read back from disk) run on one core too.
            cache = engine.core.adapter_cache
            assert cache is not None
            assert cache._executor.submit(torch.get_num_threads).result() == 1
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
    assert seen["built_on"] == "loraplex-engine"
    name, threads = seen["read_on"]
    assert name.startswith("loraplex-adapter-read") and threads == 1
    assert torch.get_num_threads() == 2


def test_a_model_that_fails_to_load_fails_start(tmp_path: Path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError):
        engine.start_sync()
    assert not engine.is_ready()
    asyncio.run(engine.shutdown())
