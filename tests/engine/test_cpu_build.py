"""Building the CPU kernels: cached per source, refused builds and switches fall back, and
the switches are the engine's settings (environment variables give their defaults)."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from loraplex_kernels import cpu_build, cpu_decode, cpu_ops

SOURCE = '#include "answer.h"\nint answer(void) { return ANSWER; }\n'
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _declare(lib: ctypes.CDLL) -> None:
    lib.answer.restype = ctypes.c_int


@pytest.fixture
def kernel_cache(tmp_path: Path) -> Iterator[Path]:
    """Builds go to a directory of their own; the process's settings come back after."""
    before = cpu_build.current_settings()
    cache = tmp_path / "cache"
    cpu_build.configure(cpu_build.KernelSettings(cache_dir=cache))
    yield cache
    cpu_build.configure(before)


def _source(directory: Path, text: str = SOURCE, answer: int = 42) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "answer.h").write_text(f"#define ANSWER {answer}\n")
    path = directory / "answer.c"
    path.write_text(text)
    return path


@needs_cc
def test_a_kernel_builds_once_and_is_reused(kernel_cache: Path, tmp_path: Path) -> None:
    source = _source(tmp_path / "src")
    lib = cpu_build.LazyLibrary("answer", source, _declare).get()
    assert lib is not None and lib.answer() == 42
    built = list(kernel_cache.glob("answer_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = cpu_build.LazyLibrary("answer", source, _declare).get()
    assert again is not None and again.answer() == 42
    assert built[0].stat().st_mtime_ns == mtime  # found in the cache, not rebuilt
    other = cpu_build.LazyLibrary(
        "answer", _source(tmp_path / "src2", SOURCE.replace("ANSWER", "7")), _declare
    ).get()
    assert other is not None and other.answer() == 7
    assert len(list(kernel_cache.glob("answer_*.so"))) == 2  # keyed by the source
    header = cpu_build.LazyLibrary("answer", _source(tmp_path / "src3", answer=9), _declare)
    assert (lib := header.get()) is not None and lib.answer() == 9
    assert len(list(kernel_cache.glob("answer_*.so"))) == 3  # and by the headers beside it
    defined = cpu_build.LazyLibrary(
        "answer", _source(tmp_path / "src4", "int answer(void) { return N; }\n"), _declare,
        defines={"N": 5},
    )
    assert (lib := defined.get()) is not None and lib.answer() == 5


def test_a_failed_build_or_a_switch_leaves_the_torch_path(
    kernel_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = cpu_build.LazyLibrary("broken", _source(tmp_path / "bad", "this is not C"), _declare)
    assert broken.get() is None
    assert not list(kernel_cache.glob("broken_*.so"))
    source = _source(tmp_path / "src")
    cpu_build.configure(cpu_build.KernelSettings(enabled=False, cache_dir=kernel_cache))
    assert cpu_build.LazyLibrary("answer", source, _declare).get() is None
    cpu_build.configure(cpu_build.KernelSettings(cache_dir=kernel_cache))
    off = cpu_build.LazyLibrary("answer", source, _declare, switch=lambda s: False)
    assert off.get() is None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_build.LazyLibrary("answer2", source, _declare).get() is None


def test_the_environment_gives_the_settings_their_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("LORAPLEX_CPU_KERNELS", "LORAPLEX_CPU_DECODE_KERNEL", "LORAPLEX_KERNEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_build.settings_from_env() == cpu_build.KernelSettings()
    assert EngineConfig().kernel_settings == cpu_build.KernelSettings()
    monkeypatch.setenv("LORAPLEX_CPU_DECODE_KERNEL", "0")
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path))
    wanted = cpu_build.KernelSettings(decode_attention=False, cache_dir=tmp_path)
    assert cpu_build.settings_from_env() == wanted
    assert EngineConfig().kernel_settings == wanted
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", "0")
    assert not EngineConfig().cpu_kernels
    assert EngineConfig(cpu_kernels=True, cpu_decode_kernel=True).kernel_settings == (
        cpu_build.KernelSettings(cache_dir=tmp_path)
    )


@needs_cc
def test_the_engine_config_switches_the_kernels(tiny_model_factory) -> None:
    from engine.core.model_runner import ModelRunner

    before = cpu_build.current_settings()
    model_dir = tiny_model_factory("llama_gqa")
    cpu = torch.device("cpu")
    try:
        runner = ModelRunner(EngineConfig(device="cpu", num_threads=1, cpu_kernels=False),
                             model_dir)
        assert not cpu_ops.available(cpu, torch.float32)
        assert not cpu_decode.available(cpu, torch.float32)
        assert runner.fast_paths()["fused norm, activation, K/V write and LoRA kernels"] is False
        ModelRunner(EngineConfig(device="cpu", num_threads=1, cpu_decode_kernel=False),
                    model_dir)
        assert cpu_ops.available(cpu, torch.float32)
        assert not cpu_decode.available(cpu, torch.float32)
        runner = ModelRunner(EngineConfig(device="cpu", num_threads=1), model_dir)
        assert cpu_ops.available(cpu, torch.float32)
        assert cpu_decode.available(cpu, torch.float32)
        assert all(runner.fast_paths().values()), runner.fast_paths()
    finally:
        cpu_build.configure(before)
