"""Memory knobs: the KV cache budget under gpu_memory_utilization, the CUDA dtype rules,
the plan and the engine sizing the same cache, and the CPU footprint (packed weights
replace the unpacked ones, the KV cache is backed only where it is written)."""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.memory import (
    CUDA_CONTEXT_BYTES,
    GIB,
    MemoryModel,
    WorkerShape,
    kv_cache_budget,
)
from engine.core.model_runner import ModelRunner, resolve_device_dtype
from engine.models.attention import allocate_kv_cache
from engine.models.cpu_linear import pack_linears, packing_available
from engine.models.loader import load_model_config
from engine.runtime.cpu_features import auto_cpu_dtype
from engine.runtime.host_memory import IdleTrimmer, release_free_memory

MODELS = Path(__file__).parents[1] / "fixtures" / "placement" / "models"
MIB = 1 << 20


# ---------------------------------------------------------------- the budget


def _budget(**overrides: float) -> int:
    numbers: dict[str, float] = dict(
        total_bytes=10_000, weights_bytes=3_000, activation_bytes=1_000, kv_bytes_per_token=10,
        gpu_memory_utilization=0.9, block_size=16,
    )
    numbers.update(overrides)
    return kv_cache_budget(**numbers).kv_cache_tokens  # type: ignore[arg-type]


def test_the_cache_gets_what_the_utilisation_limit_leaves() -> None:
    # 9,000 allowed - 3,000 weights - 1,000 activations = 5,000 bytes: 500 tokens -> 496.
    assert _budget() == 496
    assert _budget(gpu_memory_utilization=1.0) == 592  # 6,000 bytes: 600 -> 592
    assert _budget(gpu_memory_utilization=0.5) == 96  # 1,000 bytes: 100 -> 96
    assert _budget(non_torch_bytes=1_000) == 400  # 4,000 bytes
    assert _budget(activation_bytes=2_000) == 400  # a bigger profiled step
    assert _budget(block_size=1) == 500


def test_the_decode_gather_share_grows_with_the_cache() -> None:
    # Each token costs 10 bytes plus a tenth of them in the gather: 5,000 / 11 = 454 -> 448.
    budget = kv_cache_budget(
        total_bytes=10_000, weights_bytes=3_000, activation_bytes=1_000, kv_bytes_per_token=10,
        gpu_memory_utilization=0.9, block_size=16, kv_gather_divisor=10,
    )
    assert budget.kv_cache_tokens == 448
    assert budget.kv_cache_bytes == 4_480
    assert budget.limit_bytes == 9_000


@pytest.mark.parametrize("overrides", [
    {"weights_bytes": 9_000}, {"weights_bytes": 12_000}, {"activation_bytes": 5_990},
    {"gpu_memory_utilization": 0.4}, {"non_torch_bytes": 4_900},
])
def test_nothing_left_is_zero_tokens(overrides: dict[str, float]) -> None:
    assert _budget(**overrides) == 0


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_utilisation_outside_zero_one_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        _budget(gpu_memory_utilization=value)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        WorkerShape(gpu_memory_utilization=value)


# ---------------------------------------------------------------- CUDA without a GPU


class FakeCuda:
    """What torch.cuda reports for a device this machine does not have: its capability and
    its allocator's statistics. The engine's own code runs for real around them."""

    def __init__(self, *, capability: tuple[int, int] = (9, 0), total: int = 0,
                 weights: int = 0, activations: int = 0, non_torch: int = 0) -> None:
        self.capability = capability
        self.total, self.weights, self.activations = total, weights, activations
        self.non_torch = non_torch
        self.scratch = 0  # the profiling step's scratch KV cache, set by the test

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda

        @contextlib.contextmanager
        def device(_: object) -> Iterator[None]:
            yield

        peak = self.weights + self.activations + self.scratch
        values = {
            "is_available": lambda: True,
            "device": device,
            "get_device_capability": lambda *_: self.capability,
            "get_device_name": lambda *_: f"Fake GPU sm_{self.capability[0]}{self.capability[1]}",
            "is_bf16_supported": lambda including_emulation=True: self.capability >= (8, 0),
            "synchronize": lambda *_: None,
            "empty_cache": lambda: None,
            "reset_peak_memory_stats": lambda *_: None,
            "memory_allocated": lambda *_: self.weights,
            "max_memory_allocated": lambda *_: peak,
            "memory_reserved": lambda *_: peak,
            "mem_get_info": lambda *_: (self.total - peak - self.non_torch, self.total),
        }
        for name, value in values.items():
            monkeypatch.setattr(cuda, name, value)


@pytest.mark.parametrize(("capability", "expected"), [
    ((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16),
    ((6, 0), torch.float16),
])
def test_auto_dtype_on_cuda_is_bf16_where_supported_else_fp16(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: torch.dtype
) -> None:
    FakeCuda(capability=capability).install(monkeypatch)
    assert resolve_device_dtype("cuda:0", "auto") == (torch.device("cuda:0"), expected)
    assert resolve_device_dtype("cuda:0", "float16")[1] == torch.float16
    # The CPU's auto follows its bf16 units (tests/engine/test_cpu_features.py forces both).
    assert resolve_device_dtype("cpu", "auto")[1] == auto_cpu_dtype()


def test_bf16_on_a_gpu_without_it_is_refused_naming_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(capability=(7, 0)).install(monkeypatch)
    with pytest.raises(ValueError, match=r"bfloat16 is not supported on Fake GPU sm_70 "
                                         r"\(compute capability 7\.0; bfloat16 needs 8\.0 "
                                         r"or newer\): use --dtype float16"):
        resolve_device_dtype("cuda", "bfloat16")
    FakeCuda(capability=(8, 6)).install(monkeypatch)
    assert resolve_device_dtype("cuda", "bfloat16")[1] == torch.bfloat16


# ---------------------------------------------------------------- plan == engine


def _cuda_sized_runner(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, fake: FakeCuda, **settings: object
) -> ModelRunner:
    """A runner whose KV cache is sized by the CUDA path: the model and its profiling step
    run for real on the CPU, the allocator's statistics come from `fake`."""
    fake.install(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_kv_budget", ModelRunner._profile_kv_budget)
    return ModelRunner(EngineConfig(device="cpu", num_threads=1, **settings), model_dir)  # type: ignore[arg-type]


def _scratch_bytes(cfg: EngineConfig, max_model_len: int, kv_bytes_per_token: int) -> int:
    """The profiling step's scratch KV cache: one sequence's blocks each."""
    num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * max_model_len)
    seqs = min(cfg.max_num_seqs, num_tokens)
    lens = [num_tokens // seqs + (i < num_tokens % seqs) for i in range(seqs)]
    return sum(-(-n // cfg.block_size) for n in lens) * cfg.block_size * kv_bytes_per_token


@pytest.mark.parametrize(("settings", "device_gib"), [
    ({"max_num_batched_tokens": 256}, 2.0),
    ({"gpu_memory_utilization": 0.5, "max_loras": 2}, 4.0),
    ({"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_loras": 1}, 1.25),
    ({"gpu_memory_utilization": 0.95, "max_lora_rank": 8, "block_size": 32}, 1.5),
])
def test_the_plan_and_the_engine_size_the_same_cache(
    monkeypatch: pytest.MonkeyPatch, tiny_model_factory, settings: dict[str, object],
    device_gib: float,
) -> None:
    """A device that measures what the plan estimates gets the KV cache the plan reports."""
    model_dir = tiny_model_factory("llama_gqa")
    cfg = load_model_config(model_dir)
    engine_cfg = EngineConfig(**settings)  # type: ignore[arg-type]
    shape = WorkerShape(
        dtype="float32", max_loras=engine_cfg.max_loras, max_lora_rank=engine_cfg.max_lora_rank,
        max_num_seqs=engine_cfg.max_num_seqs,
        max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
        block_size=engine_cfg.block_size,
        gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
    )
    plan = MemoryModel(cfg, shape)
    device = int(device_gib * GIB)
    fixed = plan.breakdown(0)
    fake = FakeCuda(total=device, weights=fixed.weights + fixed.adapters,
                    activations=fixed.activations, non_torch=fixed.cuda_context)
    fake.scratch = _scratch_bytes(engine_cfg, cfg.max_model_len, plan.kv_bytes_per_token)
    runner = _cuda_sized_runner(monkeypatch, model_dir, fake, **settings)

    assert runner.kv_budget == plan.kv_cache_budget(device)
    tokens = plan.kv_cache_tokens(device)
    assert tokens > 0
    assert runner.num_blocks * runner.block_size == tokens
    assert runner.kv_caches[0].key.shape[0] == runner.num_blocks
    assert plan.breakdown(tokens).total <= device * shape.gpu_memory_utilization
    assert runner.kv_budget.non_torch_bytes == CUDA_CONTEXT_BYTES


def test_the_profiling_step_runs_every_lora_slot_and_leaves_them_empty(
    tiny_model_factory,
) -> None:
    runner = ModelRunner(
        EngineConfig(device="cpu", num_threads=1, kv_cache_tokens=64, max_loras=3,
                     max_lora_rank=4, max_num_seqs=5, max_num_batched_tokens=37),
        tiny_model_factory("llama_gqa"),
    )
    scratch = runner.profile_run(runner.max_model_len)
    # 5 sequences of 8, 8, 7, 7, 7 tokens: one 16-token block each.
    assert scratch == 5 * 16 * runner.kv_bytes_per_token
    assert runner.lora is not None
    groups = [g for by_name in runner.lora.groups for g in by_name.values()]
    assert not any(g.slot_active[s] or g.packed[s] for g in groups for s in range(3))


def test_refuses_to_start_when_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch, tiny_model_factory
) -> None:
    fake = FakeCuda(total=100 * MIB, weights=80 * MIB, activations=15 * MIB)
    with pytest.raises(ValueError, match=r"no memory is left for the KV cache: limit 0\.09 "
                                         r"GiB: weights and adapter slots 0\.08 \+ peak "
                                         r"activations 0\.01.*raise --gpu-memory-utilization"):
        _cuda_sized_runner(monkeypatch, tiny_model_factory("llama_gqa"), fake,
                           gpu_memory_utilization=0.9)


# ---------------------------------------------------------------- the CPU footprint


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                    reason="oneDNN packing is not available")
def test_packing_releases_the_unpacked_weights() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))
    weights = [weakref.ref(m.weight) for m in model if isinstance(m, nn.Linear)]
    biases = [model[0].bias.detach().clone()]
    assert pack_linears(model) == 2
    gc.collect()
    assert [w() for w in weights] == [None, None]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model[0].bias, biases[0])


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                    reason="oneDNN packing is not available")
def test_a_packed_runner_holds_no_unpacked_linear_weight(tiny_model_factory) -> None:
    runner = ModelRunner(EngineConfig(device="cpu", num_threads=1, kv_cache_tokens=64),
                         tiny_model_factory("llama_gqa"))
    assert not any(isinstance(m, nn.Linear) for m in runner.model.modules())
    # Parameters left: embeddings and norms (and biases), nothing of a linear's size.
    names = {name.rsplit(".", 1)[0].rsplit(".", 1)[-1] for name, _ in
             runner.model.named_parameters()}
    assert names <= {"embed_tokens", "norm", "input_layernorm", "post_attention_layernorm",
                     "qkv", "o_proj", "gate_up", "down_proj", "q_norm", "k_norm"}
    assert all(p.dim() == 1 or "embed" in n for n, p in runner.model.named_parameters())


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc")
def test_the_cpu_kv_cache_is_backed_only_where_written() -> None:
    # 2 layers x K and V x 256 MiB: 1 GiB of cache.
    shape = (8192, 16, 8, 64)
    before = _rss_bytes()
    caches = allocate_kv_cache(2, *shape, torch.float32, torch.device("cpu"))
    allocated = _rss_bytes()
    assert allocated - before < 32 * MIB
    for cache in caches:
        assert cache.key.shape == cache.value.shape == shape
        assert cache.key.is_contiguous() and cache.key.dtype == torch.float32
    # It reads as zeros (padded block tables point at real blocks), and writing 64 of its
    # 8,192 blocks backs about that much.
    assert not caches[0].key[::512].any()
    for cache in caches:
        cache.key[:64].fill_(1.0)
        cache.value[:64].fill_(1.0)
    written = _rss_bytes()
    assert written - allocated < 4 * 64 * 16 * 8 * 64 * 4 + 16 * MIB
    assert float(caches[1].value[63].sum()) == 16 * 8 * 64
    assert not caches[1].value[64:].any()


def _mapping_rss_bytes(address: int) -> int:
    """The resident bytes of the mapping of this process that holds `address` (smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            if start <= address < end:
                for detail in lines[i + 1:]:
                    if detail.startswith("Rss:"):
                        return int(detail.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs /proc")
@pytest.mark.parametrize("prefault", [False, True])
def test_a_prefaulted_cpu_kv_cache_is_backed_from_the_start(prefault: bool) -> None:
    shape = (1024, 16, 8, 64)  # 32 MiB per tensor in float32
    nbytes = 1024 * 16 * 8 * 64 * 4
    caches = allocate_kv_cache(2, *shape, torch.float32, torch.device("cpu"), prefault=prefault)
    resident = [_mapping_rss_bytes(t.data_ptr()) for c in caches for t in (c.key, c.value)]
    if prefault:
        assert all(r >= nbytes for r in resident), resident
    else:
        assert all(r < nbytes // 8 for r in resident), resident
    # Either way it reads as zeros and takes writes.
    assert not any(t.any() for c in caches for t in (c.key, c.value))
    caches[1].value[3].fill_(2.0)
    assert float(caches[1].value.sum()) == 2.0 * 16 * 8 * 64


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs /proc")
def test_the_runner_prefaults_its_cache_as_configured(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    for prefault in (True, False):
        runner = ModelRunner(EngineConfig(device="cpu", num_threads=1, kv_cache_tokens=1 << 16,
                                          kv_cache_prefault=prefault), model_dir)
        cache = runner.kv_caches[0].key
        nbytes = cache.numel() * cache.element_size()
        assert nbytes >= 4 * MIB  # large enough for the lazy side to show
        resident = _mapping_rss_bytes(cache.data_ptr())
        assert (resident >= nbytes) if prefault else (resident < nbytes // 2), (prefault, resident)


def test_the_prefault_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_KV_CACHE_PREFAULT", raising=False)
    assert EngineConfig().kv_cache_prefault is True
    monkeypatch.setenv("LORAPLEX_KV_CACHE_PREFAULT", "0")
    assert EngineConfig().kv_cache_prefault is False


@pytest.mark.skipif(not release_free_memory(), reason="needs glibc's malloc_trim")
def test_the_heap_is_trimmed_after_a_quiet_spell_not_during_steps() -> None:
    trimmer = IdleTrimmer(idle_s=0.05)
    with trimmer.busy():
        time.sleep(0.2)  # a long step: no trim while it runs
        assert trimmer.num_trims == 0
    deadline = time.monotonic() + 10
    while trimmer.num_trims == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trimmer.num_trims == 1
    time.sleep(0.2)  # nothing ran since: no second trim
    assert trimmer.num_trims == 1
