"""Building the CPU kernels: cached per source, refused builds and switches fall back."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from loraplex_kernels import cpu_build

SOURCE = "int answer(void) { return 42; }\n"


def _declare(lib: ctypes.CDLL) -> None:
    lib.answer.restype = ctypes.c_int


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_kernel_builds_once_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path))
    lib = cpu_build.LazyLibrary("answer", SOURCE, _declare).get()
    assert lib is not None and lib.answer() == 42
    built = list(tmp_path.glob("answer_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = cpu_build.LazyLibrary("answer", SOURCE, _declare).get()
    assert again is not None and again.answer() == 42
    assert built[0].stat().st_mtime_ns == mtime  # found in the cache, not rebuilt
    other = cpu_build.LazyLibrary("answer", SOURCE.replace("42", "7"), _declare).get()
    assert other is not None and other.answer() == 7
    assert len(list(tmp_path.glob("answer_*.so"))) == 2  # keyed by the source


def test_a_failed_build_or_a_switch_leaves_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path))
    broken = cpu_build.LazyLibrary("broken", "this is not C", _declare)
    assert broken.get() is None
    assert not list(tmp_path.glob("broken_*.so"))
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", "0")
    assert cpu_build.LazyLibrary("answer", SOURCE, _declare).get() is None
    monkeypatch.delenv("LORAPLEX_CPU_KERNELS")
    monkeypatch.setenv("SWITCH", "0")
    assert cpu_build.LazyLibrary("answer", SOURCE, _declare, env_switch="SWITCH").get() is None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_build.LazyLibrary("answer2", SOURCE, _declare).get() is None
