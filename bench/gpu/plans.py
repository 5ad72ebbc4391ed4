"""What each mode of the GPU check runs: shapes, batch sizes and workloads, one `Plan`
for a CUDA device and one for the CPU dry run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.gpu.models import LLAMA3_8B, SMOLLM2_135M, TINY_LLAMA3, TINY_SMOLLM2, ModelShape


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a mode sizes. The GPU sizes are planned to fit one H200 in 8 minutes (not
    measured there yet; budget_s and run.sh's limit bound the run); the dry-run sizes run
    the same code on two CPU cores in well under a minute."""

    dry_run: bool
    test_select: str | None  # pytest -k for tests/gpu; None: all of them
    tests_timeout_s: float
    kernel_dims: tuple[int, int, int, int]  # hidden, intermediate, q size, kv size
    accuracy_batches: tuple[tuple[str, int, int, str], ...]  # BatchSpec fields
    bandwidth_batches: tuple[tuple[str, int, int, str], ...]
    copy_bytes: int
    timing_warmup: int
    timing_iters: int
    identity: IdentityPlan
    throughput: ThroughputPlan
    budget_s: float  # a step is not started past this many seconds from the start


@dataclass(frozen=True, slots=True)
class IdentityPlan:
    shape: ModelShape
    num_prompts: int
    prompt_len: tuple[int, int]
    new_tokens: int
    adapter_ranks: tuple[int, ...]  # one adapter per rank, targets alternating
    kv_cache_tokens: int


@dataclass(frozen=True, slots=True)
class ThroughputPlan:
    shape: ModelShape
    dtype: torch.dtype
    concurrency: tuple[int, ...]  # engine runs of this many sequences at once
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch_size: int  # HF / PEFT static batches of at most this many requests
    adapter_counts: tuple[int, ...]  # multi-LoRA runs over this many distinct adapters
    lora_requests: int
    lora_prompt_len: tuple[int, int]
    lora_output_len: tuple[int, int]
    lora_rank: int
    overhead_adapters: int  # the LoRA-overhead run: rows round robin over this many
    decode_batch_sizes: tuple[int, ...]
    decode_prompt_len: int
    decode_timed_steps: int


GPU_PLAN = Plan(
    dry_run=False,
    test_select=None,
    tests_timeout_s=240.0,
    kernel_dims=(4096, 14336, 4096, 1024),  # Llama-3-8B
    accuracy_batches=(
        ("decode-256-distinct", 256, 1, "distinct"),
        ("decode-256-skewed", 256, 1, "skewed"),
        ("prefill-16x128-skewed", 16, 128, "skewed"),
    ),
    bandwidth_batches=(
        ("decode-256-distinct", 256, 1, "distinct"),
        ("decode-64-distinct", 64, 1, "distinct"),
    ),
    copy_bytes=2 * 2**30,
    timing_warmup=5,
    timing_iters=20,
    identity=IdentityPlan(
        shape=SMOLLM2_135M,
        num_prompts=10,
        prompt_len=(16, 300),
        new_tokens=32,
        adapter_ranks=(8, 16, 32, 64),
        kv_cache_tokens=65536,
    ),
    throughput=ThroughputPlan(
        shape=LLAMA3_8B,
        dtype=torch.bfloat16,
        concurrency=(64, 256),
        prompt_len=(128, 512),
        output_len=(64, 128),
        hf_batch_size=64,
        adapter_counts=(16, 64),
        lora_requests=64,
        lora_prompt_len=(64, 256),
        lora_output_len=(16, 32),
        lora_rank=16,
        overhead_adapters=16,
        decode_batch_sizes=(64, 256),
        decode_prompt_len=64,
        decode_timed_steps=16,
    ),
    budget_s=420.0,
)

DRY_RUN_PLAN = Plan(
    dry_run=True,
    # Two of the Triton kernel tests (all of them take ~10-20 s in the interpreter here),
    # the kernels at the plan's shapes and the engine against HF.
    test_select=("strided_activation_views or slot_without_any_adapted_slice "
                 "or serving_shapes or engine_matches_hf"),
    tests_timeout_s=180.0,
    kernel_dims=(32, 48, 32, 16),
    accuracy_batches=(
        ("decode-4-distinct", 4, 1, "distinct"),
        ("prefill-2x20-skewed", 2, 20, "skewed"),
    ),
    bandwidth_batches=(("decode-4-distinct", 4, 1, "distinct"),),
    copy_bytes=4 * 2**20,
    timing_warmup=1,
    timing_iters=2,
    identity=IdentityPlan(
        shape=TINY_SMOLLM2,
        num_prompts=3,
        prompt_len=(4, 12),
        new_tokens=4,
        adapter_ranks=(8, 16),
        kv_cache_tokens=1024,
    ),
    throughput=ThroughputPlan(
        shape=TINY_LLAMA3,
        dtype=torch.float32,
        concurrency=(4, 8),
        prompt_len=(8, 24),
        output_len=(4, 8),
        hf_batch_size=4,
        adapter_counts=(2, 4),
        lora_requests=4,
        lora_prompt_len=(8, 16),
        lora_output_len=(3, 5),
        lora_rank=16,
        overhead_adapters=2,
        decode_batch_sizes=(4,),
        decode_prompt_len=8,
        decode_timed_steps=3,
    ),
    budget_s=300.0,
)
