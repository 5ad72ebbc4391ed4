"""A new prompt's attention in bf16: torch's flash kernel against loraplex's
(loraplex_kernels/cpu_attention.py, each variant this CPU has), one layer's worth of the
prompts of a prefill step (SmolLM2's 9 query / 3 KV heads of 64; prompt lengths drawn as
the served burst draws them), with each kernel's largest error against exact float32
attention; then a whole prefill step of the engine over such prompts, with the kernel
switched on and off (`LORAPLEX_CPU_PREFILL_KERNEL`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.roofline import best_seconds


@dataclass(slots=True)
class PrefillAttentionOptions:
    model: str = "default"
    prompt_len: tuple[int, int] = opt((20, 400), "min-max prompt tokens")
    num_prompts: int = opt(12, "prompts of one prefill step")
    heads: int = opt(9, "query heads")
    kv_heads: int = opt(3, "KV heads")
    head_dim: int = opt(64, "head size")
    repeats: int = opt(5, "timed rounds (the best is reported)")
    step: bool = opt(True, "also time the engine's prefill step (loads the model)")
    seed: int = 0
    output: Path | None = None


def run_prefill_attention(opts: PrefillAttentionOptions) -> dict[str, Any]:
    from loraplex_kernels import cpu_attention
    from loraplex_kernels import reference as ref

    report = report_header("prefill_attention", opts)
    rng = random.Random(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    lens = [rng.randint(*opts.prompt_len) for _ in range(opts.num_prompts)]
    h, kvh, d = opts.heads, opts.kv_heads, opts.head_dim
    seqs = [tuple((torch.randn(n, heads, d, generator=gen)).bfloat16() for heads in (h, kvh, kvh))
            for n in lens]
    scale = d**-0.5
    exact = [ref.dense_causal_attention_reference(q.float(), k.float(), v.float(), scale)
             for q, k, v in seqs]
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "torch_flash": lambda q, k, v: ref.causal_attention(q, k, v, scale)}
    if cpu_attention.available():
        kernels["dot_product"] = lambda q, k, v: cpu_attention.causal_attention(
            q, k, v, scale, tiles=False)
    if cpu_attention.uses_tiles():
        kernels["amx_tiles"] = lambda q, k, v: cpu_attention.causal_attention(
            q, k, v, scale, tiles=True)
    flops = sum(n * (n + 1) // 2 * h * d * 4 for n in lens)  # QK^T and PV, causal half
    report["prompt_tokens"] = sum(lens)
    layer: dict[str, Any] = {}
    for name, attend in kernels.items():
        def one_layer(attend: Any = attend) -> list[torch.Tensor]:
            return [attend(q, k, v) for q, k, v in seqs]
        err = max(float((got.float() - want).abs().max())
                  for got, want in zip(one_layer(), exact, strict=True))
        ms = round(best_seconds(one_layer, opts.repeats) * 1e3, 3)
        layer[name] = {"ms": ms, "gflops": round(flops / ms / 1e6, 1), "max_abs_error": err}
        print_row(name, layer[name])
    report["one_layer"] = layer
    if opts.step:
        report["prefill_step_ms"] = _prefill_steps(opts, lens)
        print_row("prefill_step_ms", report["prefill_step_ms"])
    write_report(report, opts.output)
    return report


def _prefill_steps(opts: PrefillAttentionOptions, lens: list[int]) -> dict[str, float]:
    """One prefill step of the engine (bf16) over prompts of `lens`' lengths, best of
    `repeats`, with the prompt attention kernel on and off."""
    from bench.lora import resolve_model
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.request import EngineRequest, SamplingParams
    from loraplex_kernels import cpu_build

    model_dir, _ = resolve_model(opts.model)
    out: dict[str, float] = {}
    rng = random.Random(opts.seed + 1)
    counter = 0
    for kernel in (True, False):
        core = EngineCore(EngineConfig(model=str(model_dir), dtype="bfloat16",
                                       enable_prefix_caching=False,
                                       cpu_prefill_kernel=kernel,
                                       max_num_batched_tokens=max(2048, sum(lens))))
        best = float("inf")
        for round_ in range(opts.repeats + 1):  # round 0 warms up
            for n in lens:
                counter += 1
                ids = tuple(rng.randrange(100, 40000) for _ in range(n))
                core.add_request(EngineRequest(
                    request_id=f"p{counter}", prompt_token_ids=ids,
                    sampling=SamplingParams(max_tokens=1, temperature=0)))
            start = time.perf_counter()
            core.step()
            if round_:
                best = min(best, time.perf_counter() - start)
            while core.has_unfinished_requests():
                core.step()
        out["kernel" if kernel else "torch_flash"] = round(best * 1e3, 1)
    cpu_build.configure(EngineConfig().kernel_settings)
    return out
