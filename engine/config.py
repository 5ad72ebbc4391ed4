"""Engine settings: one dataclass, filled by the CLI or by tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from loraplex_kernels.cpu_build import KernelSettings, env_cache_dir, env_switch

if TYPE_CHECKING:
    import torch


def default_data_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_DATA_DIR", "./var"))


def default_kv_cache_prefault() -> bool:
    """LORAPLEX_KV_CACHE_PREFAULT ("0": off), else on."""
    return env_switch("LORAPLEX_KV_CACHE_PREFAULT")


def default_dtype() -> str:
    """LORAPLEX_DTYPE, else "auto" (engine/model_runner.resolve_device_dtype)."""
    return os.environ.get("LORAPLEX_DTYPE", "auto")


# Quantization of a base model (engine/models/quantized.py): weight-only int8 / int4 / fp8,
# or int8 weights with int8 activations (w8a8).
SCHEMES = ("none", "int8", "int4", "fp8", "w8a8")
DEFAULT_INT4_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class QuantizationSpec:
    scheme: str = "none"  # one of SCHEMES
    group_size: int | None = None  # None: per channel for int8, DEFAULT_INT4_GROUP_SIZE for int4

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {self.scheme!r} ({', '.join(SCHEMES)})")
        if self.group_size is not None:
            if self.scheme not in ("int8", "int4"):
                raise ValueError("--quantization-group-size applies to int8 and int4 only")
            if self.group_size < 2 or self.group_size % 2:
                raise ValueError(
                    f"--quantization-group-size must be an even number >= 2, got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp8": 8, "w8a8": 8}.get(self.scheme, 0)

    @property
    def int8_activations(self) -> bool:
        """Whether the linear layers' inputs are quantized to int8 too (w8a8), not only
        their weights."""
        return self.scheme == "w8a8"

    @property
    def group(self) -> int | None:
        """The group size every layer is quantized with (None: one group per output
        channel)."""
        if self.scheme == "int4":
            return self.group_size or DEFAULT_INT4_GROUP_SIZE
        return self.group_size

    def check_device(self, device: torch.device) -> None:
        """Refuse, in one line, a scheme this device cannot serve."""
        import torch

        if self.scheme == "fp8":
            if device.type != "cuda":
                raise ValueError(
                    "--quantization fp8 needs a CUDA GPU of compute capability 8.9 or newer "
                    "(fp8 units); on this CPU use w8a8, int8 or int4")
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise ValueError(
                    f"--quantization fp8 needs compute capability 8.9 or newer; "
                    f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use int8 "
                    "or int4")
        if self.int8_activations and device.type != "cpu":
            raise ValueError(f"--quantization w8a8 runs on the CPU; on {device} use fp8 "
                             "(compute capability 8.9 or newer), int8 or int4")

    def describe(self) -> str:
        if not self.enabled:
            return "none"
        group = self.group
        if self.int8_activations:
            return "w8a8 (int8 weights per channel, int8 activations in groups)"
        if self.scheme == "fp8":
            return "fp8 (e4m3 weights per channel, activations per row)"
        return f"{self.scheme} ({'per channel' if group is None else f'groups of {group}'})"


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"  # "default" (bundled SmolLM2) or a local HF directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto | float32 | bfloat16 | float16; auto: bf16 on CUDA (fp16 where it lacks bf16) and
    # on CPUs with AMX-BF16, or AVX-512 BF16 where bf16 timed faster at start
    # (engine/runtime/cpu_features.py), else float32.
    dtype: str = field(default_factory=default_dtype)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Long prompts (engine/core/scheduler.py, NOTE: long prefills): a prefill with more than
    # long_prefill_token_threshold tokens still to compute is "long"; it gets at most that
    # many tokens of a step until every other request was served, then what is left.
    # None: a quarter of max_num_batched_tokens; 0: no cap. At most max_num_partial_prefills
    # prefills per step stop short of their prompt's end, at most max_long_partial_prefills
    # of them long.
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # KV cache capacity in tokens; None sizes it from the device (CPU: enough for
    # max_num_seqs sequences of max_model_len, capped).
    kv_cache_tokens: int | None = None
    # CPU: back the whole KV cache with memory when the engine starts (its RSS from the
    # start), instead of page by page as blocks are first written: a first write into a
    # page in a step costs a page fault there (see engine/models/attention.py). Blocks are
    # handed out fresh before reused ones, so a busy server backs all of them soon anyway.
    kv_cache_prefault: bool = field(default_factory=default_kv_cache_prefault)
    # CUDA: the share of the device's total memory the engine may use (weights, activations
    # and KV cache); the cache gets what a profiled largest step leaves (vLLM's meaning).
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_lora_rank: int = 64
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores
    # Weight-only quantization of the decoder layers' linear layers (engine/models/
    # quantized.py): none | int8 | int4 | fp8; quantization_group_size None: per output
    # channel for int8, 32 inputs for int4.
    quantization: str = field(
        default_factory=lambda: os.environ.get("LORAPLEX_QUANTIZATION", "none"))
    quantization_group_size: int | None = None
    # CPU: run linear layers on oneDNN-packed weights (see engine/models/cpu_linear.py).
    pack_cpu_weights: bool = True
    # CPU: the C kernels (loraplex_kernels/cpu_build.py). cpu_kernels False runs every op
    # on its torch path (for comparisons), cpu_decode_kernel False decode attention alone,
    # cpu_prefill_kernel False new bf16 prompts' attention alone (torch's flash kernel
    # instead of loraplex_kernels/cpu_attention.py); cpu_gemm False keeps every bf16 linear
    # layer on oneDNN (loraplex_kernels/cpu_gemm.py: without AMX it runs every step's bf16
    # linears on the dot-product instruction); cpu_amx False keeps bf16 decode steps' linear
    # layers and new prompts' attention off AMX tiles where the CPU has them (on, each such
    # linear layer holds its weights twice: in oneDNN's layout for prefill and in the tiles');
    # builds are cached in kernel_cache_dir (None: ~/.cache/loraplex/kernels).
    # Defaults: LORAPLEX_CPU_KERNELS, LORAPLEX_CPU_DECODE_KERNEL, LORAPLEX_CPU_PREFILL_KERNEL,
    # LORAPLEX_CPU_GEMM and LORAPLEX_CPU_AMX ("0": off), LORAPLEX_KERNEL_CACHE.
    # NOTE: the kernels are the process's: the last engine started in it sets them.
    cpu_kernels: bool = field(default_factory=lambda: env_switch("LORAPLEX_CPU_KERNELS"))
    cpu_decode_kernel: bool = field(
        default_factory=lambda: env_switch("LORAPLEX_CPU_DECODE_KERNEL")
    )
    cpu_prefill_kernel: bool = field(
        default_factory=lambda: env_switch("LORAPLEX_CPU_PREFILL_KERNEL")
    )
    cpu_gemm: bool = field(default_factory=lambda: env_switch("LORAPLEX_CPU_GEMM"))
    cpu_amx: bool = field(default_factory=lambda: env_switch("LORAPLEX_CPU_AMX"))
    kernel_cache_dir: Path | None = field(default_factory=env_cache_dir)
    data_dir: Path | None = None  # None: LORAPLEX_DATA_DIR or ./var
    # Servers (serve, worker, demo): step the engine in a process of its own, apart from
    # the event loop's (engine/core_process.py), instead of a thread of the server's.
    engine_process: bool = False
    # Order of waiting requests within a priority (see engine/core/fairness.py): "vtc" serves
    # the tenant with the least weighted service first; "fcfs" serves by arrival.
    fairness: Literal["vtc", "fcfs"] = "vtc"
    vtc_prompt_weight: float = 1.0  # VTC cost of one prompt token computed (w_p)
    vtc_output_weight: float = 2.0  # VTC cost of one output token generated (w_q)
    # A waiting request's priority improves by one level per aging_s seconds waited (down
    # to 0), so low-priority requests are never starved; None: no aging.
    aging_s: float | None = 30.0
    # Requests of this priority number or more are background work (the batch tier and
    # adapter evals: app.tables.Tier): a CPU step whose rows are all theirs is cut short
    # between layers when a request of a lower number is queued (engine/core/
    # background.py). None: no step is ever cut.
    background_priority: int | None = 2
    # Steps in a row in which nothing could run (each request failed on its own, and so
    # did a one-token probe of the device) before the engine declares itself failed.
    max_consecutive_step_failures: int = 3
    # Structured outputs (engine/structured/): a spec that takes longer to compile is
    # refused (grammar_compile_timeout); compiled grammars (and refusals) kept per spec;
    # threads compiling them, off the step loop.
    grammar_compile_timeout_s: float = 2.0
    grammar_cache_size: int = 256
    grammar_compile_threads: int = 2
    # Threads filling a step's token masks; 1: on the step thread (see TokenMasker's NOTE);
    # None: llguidance's pool of 80% of the cores.
    grammar_mask_threads: int | None = 1

    def __post_init__(self) -> None:
        QuantizationSpec(self.quantization, self.quantization_group_size)  # refuses bad ones
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if self.max_num_partial_prefills < 1 or self.max_long_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 1")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) cannot exceed "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if self.fairness not in ("vtc", "fcfs"):
            raise ValueError(f"fairness must be 'vtc' or 'fcfs', got {self.fairness!r}")
        if self.vtc_prompt_weight < 0 or self.vtc_output_weight < 0:
            raise ValueError("vtc_prompt_weight and vtc_output_weight must be >= 0")
        if self.aging_s is not None and not self.aging_s > 0:
            raise ValueError(f"aging_s must be > 0 (or None: no aging), got {self.aging_s}")
        if self.max_consecutive_step_failures < 1:
            raise ValueError("max_consecutive_step_failures must be >= 1")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if self.grammar_cache_size < 1 or self.grammar_compile_threads < 1:
            raise ValueError("grammar_cache_size and grammar_compile_threads must be >= 1")
        if self.grammar_mask_threads is not None and self.grammar_mask_threads < 1:
            raise ValueError("grammar_mask_threads must be >= 1 (or None: llguidance's pool)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                f"of {self.block_size} tokens"
            )

    @property
    def long_prefill_cap(self) -> int | None:
        """Tokens a long prefill gets in a step's first pass; None: no cap."""
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_token_threshold or None

    @property
    def kernel_settings(self) -> KernelSettings:
        return KernelSettings(
            enabled=self.cpu_kernels, decode_attention=self.cpu_decode_kernel,
            prefill_attention=self.cpu_prefill_kernel, amx=self.cpu_amx, gemm=self.cpu_gemm,
            cache_dir=self.kernel_cache_dir,
        )

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir()
