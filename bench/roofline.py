"""`loraplex bench roofline`: this CPU's limits, and a decode step against them.

One run measures the matmul peak in the step's dtype (GFLOP/s, a large `torch.mm` on every
intra-op thread) and the memory bandwidth (GB/s, a large copy and a large sum), then drives an
in-process `EngineCore` (no HTTP) through decode steps of N sequences, base model and
spread over adapters, and reports:

- the mean step time, unprofiled;
- where it goes (torch profiler, each op's self time by part: linear layers, LoRA, K/V
  write, K/V gather, decode attention, norms, rope, activation, residuals, lm_head,
  sampling, input preparation; "python" is the step time no op accounts for);
- the linear layers' achieved GFLOP/s (their flops over their profiled time, the output
  projection apart) against that peak;
- the step's roofline: the bytes it must move (every weight once, the LoRA weights of
  the slots in use, the K/V it reads) over the bandwidth, its flops over the peak; the
  bound is the larger, and `roofline_fraction` = bound / measured step.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.harness.options import internal, opt
from bench.harness.report import print_row, report_header, write_report
from bench.harness.workload import BenchRequest, random_token_ids
from bench.lora import ADAPTER_ROOT, engine_core, make_adapters, resolve_model
from engine.core.model_runner import dtype_name


@dataclass(slots=True)
class RooflineOptions:
    model: str = "default"
    num_seqs: int = 32
    context_len: tuple[int, int] = opt((200, 500), "min-max tokens")
    num_adapters: int = opt(8, "0: base model only")
    rank: int = 16
    targets: str = opt("attention", choices=("qv", "attention", "all-linear"))
    dtype: str = opt("auto", "the engine's dtype (auto: what serving picks here)",
                     choices=("auto", "float32", "bfloat16"))
    steps: int = opt(16, "timed decode steps per round")
    profiled_steps: int = internal(3)
    # the best step of the alternating rounds is kept
    repeats: int = opt(2, "alternating base/LoRA rounds")
    # Also time steps alternating between the CPU decode kernel and the gather + SDPA
    # path (loraplex_kernels/cpu_decode.py) on the same running batch.
    compare_gather: bool = opt(False, "also alternate kernel / gather steps")
    # Also time steps alternating between the fused CPU kernels (loraplex_kernels/cpu_ops.py:
    # RMSNorm, the LoRA rows of decode segments) and the torch ops they replace.
    compare_cpu_ops: bool = opt(False, "also alternate fused CPU kernels / torch ops steps")
    seed: int = 0
    output: Path | None = None


# ---------------------------------------------------------------------------- machine


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], iters: int) -> float:
    fn()
    return min(_seconds(fn) for _ in range(iters))


def matmul_peak_gflops(n: int = 2048, iters: int = 5, dtype: torch.dtype = torch.float32
                       ) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = best_seconds(lambda: torch.mm(a, b, out=out), iters)
    return 2 * n**3 / seconds / 1e9


def memory_bandwidth_gbs(mib: int = 512, iters: int = 5) -> dict[str, float]:
    """copy: bytes read + written per second; read: a sum's bytes read per second."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy_s = best_seconds(lambda: dst.copy_(src), iters)
    read_s = best_seconds(lambda: src.sum(), iters)
    return {"copy": 2 * nbytes / copy_s / 1e9, "read": nbytes / read_s / 1e9}


# ---------------------------------------------------------------------------- breakdown

# A scope's own time (outside the ops inside it: the C kernels' calls, and Python) counts
# to this part; the attention scope's is mostly the K/V write's C call.
_SCOPE_SELF_PART = {"attention": "kv_write", "lora": "lora", "norms": "norms", "rope": "rope",
                    "activation": "activation", "lm_head": "lm_head", "sampling": "sampling"}
# Scopes the profiled steps are wrapped in (see _scoped); ops outside every scope are
# classified by name.
_SCOPES = ("prepare_inputs", *_SCOPE_SELF_PART)
_KERNEL_SCOPE = "decode_kernel"
# The bf16 linear kernel's C call (loraplex_kernels/cpu_gemm.py): the linear layers' part,
# or the lm_head's when the output projection runs it. Its gate_up call with the SiLU in
# it (linear_silu_mul) counts to linear too: the weight read is nearly all of it.
_GEMM_SCOPE = "gemm_kernel"


def _op_part(op: str, scope: str | None) -> str:
    if scope == "attention":
        if "index_copy" in op:
            return "kv_write"
        if op in ("aten::index_select", "aten::index", "aten::gather", "aten::take"):
            return "kv_gather"
        return "decode_attention"
    if scope is not None:
        return scope
    if "linear" in op or op in ("aten::addmm", "aten::mm", "aten::matmul"):
        return "linear"
    if op in ("aten::silu", "aten::silu_", "aten::mul", "aten::mul_") or "silu" in op:
        return "activation"
    if op in ("aten::add", "aten::add_"):
        return "residual"
    if op in ("aten::embedding", "aten::index_select"):
        return "embedding"
    return "other_ops"


@contextlib.contextmanager
def _scoped(core: Any) -> Iterator[None]:
    """Wrap the engine's parts in profiler scopes (instance and module attributes),
    restoring them afterwards."""
    import engine.models.llama as llama
    from engine.core.model_runner import ModelRunner
    from engine.lora.layers import LoRAGroup
    from loraplex_kernels import cpu_gemm, cpu_ops

    def scope(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapped

    targets: list[tuple[Any, str, str]] = [  # (owner, attribute, scope)
        (ModelRunner, "prepare_inputs", "prepare_inputs"),
        (LoRAGroup, "apply", "lora"),
        (llama, "paged_attention", "attention"),
        (llama.RMSNorm, "forward", "norms"),
        (llama.RMSNorm, "add_forward", "norms"),
        (llama.LlamaAttention, "rope_qk", "rope"),
        (core.runner.model, "compute_logits", "lm_head"),
        (core, "sampler", "sampling"),
        (cpu_ops, "silu_mul", "activation"),
        (cpu_gemm, "linear", _GEMM_SCOPE),
        (cpu_gemm, "linear_silu_mul", _GEMM_SCOPE),
    ]
    with contextlib.suppress(ImportError):  # trees without the CPU decode kernel
        from loraplex_kernels import cpu_decode

        targets.append((cpu_decode, "paged_decode_attention", _KERNEL_SCOPE))
    with contextlib.ExitStack() as stack:
        for owner, attr, name in targets:
            stack.enter_context(mock.patch.object(owner, attr, scope(name, getattr(owner, attr))))
        yield


def profile_parts(core: Any, steps: int) -> dict[str, float]:
    """Mean op self time per step by part, in seconds."""
    from torch.profiler import ProfilerActivity, profile

    with _scoped(core), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    parts: defaultdict[str, float] = defaultdict(float)
    for event in prof.events():
        name, parent = event.name, event.cpu_parent
        if name == _KERNEL_SCOPE:  # a C call, not an op: its own time counts
            parts["decode_attention"] += event.self_cpu_time_total / 1e6
        elif name == _GEMM_SCOPE:
            on_head = parent is not None and parent.name == "lm_head"
            parts["lm_head" if on_head else "linear"] += event.self_cpu_time_total / 1e6
        elif name in _SCOPES:
            part = _SCOPE_SELF_PART.get(name)
            if part is not None and (parent is None or parent.name not in _SCOPES):
                parts[part] += event.self_cpu_time_total / 1e6
        # Only outermost ops: a nested op's time is inside its parent op's.
        elif not name.startswith("ProfilerStep") and (parent is None or parent.name in _SCOPES):
            part = _op_part(name, None if parent is None else parent.name)
            parts[part] += event.cpu_time_total / 1e6
    return {k: v / steps for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


# ---------------------------------------------------------------------------- the step


def _prefill(core: Any, requests: list[Any]) -> None:
    """Queue the requests and step until every one is decoding."""
    for r in requests:
        core.add_request(r)
    started: set[str] = set()
    while len(started) < len(requests):
        for out in core.step().outputs:
            started.add(out.request_id)


def step_model(core: Any, num_adapters: int) -> dict[str, float]:
    """Bytes and flops one decode step over the running requests must spend."""
    runner = core.runner
    cfg = runner.model_config
    model_cls = type(runner.model)
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    running = list(core.scheduler.running)
    num_seqs = len(running)
    context = sum(r.num_tokens for r in running)
    layer_params = sum(fin * fout for fin, fout in model_cls.linear_shapes(cfg).values())
    head_params = cfg.vocab_size * cfg.hidden_size
    linear_params = layer_params * cfg.num_layers + head_params
    lora_elements = 0.0  # of the slots' packed LoRA weights
    if runner.lora is not None and num_adapters:
        lora_elements = float(sum(
            packed.num_elements for by_name in runner.lora.groups for group in by_name.values()
            for packed in group.packed if packed is not None
        ))
    lora_flops = 2 * lora_elements * num_seqs / max(num_adapters, 1)
    attn_flops = 4 * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return {
        "num_seqs": num_seqs,
        "mean_context": context / max(num_seqs, 1),
        # Every parameter read once (a tied embedding matrix: as the output projection).
        "weight_bytes": model_cls.count_parameters(cfg) * itemsize,
        "lora_bytes": lora_elements * itemsize,
        "kv_read_bytes": context * runner.kv_bytes_per_token,
        "flops": 2 * num_seqs * linear_params + attn_flops + lora_flops,
        "attention_flops": attn_flops,
        "layer_linear_flops": 2 * num_seqs * layer_params * cfg.num_layers,
        "lm_head_flops": 2 * num_seqs * head_params,
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _alternate(
    core: Any, steps: int, labels: tuple[str, str], switch: Callable[[str], None]
) -> dict[str, float]:
    """Median step time under each of two settings, alternating step by step on the same
    batch (the order flips every pair); the first setting is restored after."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    try:
        for i in range(steps):
            for label in labels if i % 2 == 0 else labels[::-1]:
                switch(label)
                times[label].append(_seconds(core.step))
    finally:
        switch(labels[0])
    return {k: _ms(statistics.median(v)) for k, v in times.items()}


def compare_gather(core: Any, steps: int) -> dict[str, float]:
    """Decode attention on the kernel and on the gather path."""
    from loraplex_kernels import cpu_decode

    real = cpu_decode.available

    def switch(label: str) -> None:
        cpu_decode.available = real if label == "kernel" else _never

    return _alternate(core, steps, ("kernel", "gather"), switch)


def compare_cpu_ops(core: Any, steps: int) -> dict[str, float]:
    """RMSNorm and the LoRA rows of decode segments on the fused kernels and on torch."""
    from loraplex_kernels import cpu_ops

    real = cpu_ops.available
    lora = core.runner.lora
    groups = [g for by_name in lora.groups for g in by_name.values()] if lora else []
    chosen = [g.cpu_kernel for g in groups]

    def switch(label: str) -> None:
        fused = label == "fused"
        cpu_ops.available = real if fused else _never
        for group, was in zip(groups, chosen, strict=True):
            group.cpu_kernel = was and fused

    return _alternate(core, steps, ("fused", "torch"), switch)


def _never(device: torch.device, dtype: torch.dtype) -> bool:
    return False


def _gflops(flops: float, seconds: float | None) -> float:
    return round(flops / seconds / 1e9, 1) if seconds else 0.0


def _figures(
    step_s: float, parts: dict[str, float], model: dict[str, float], peak: float, bw: float
) -> dict[str, Any]:
    """The step's parts, and the step against the roofline (`peak` GFLOP/s, `bw` GB/s)."""
    parts["python"] = max(step_s - sum(parts.values()), 0.0)
    moved = model["weight_bytes"] + model["lora_bytes"] + model["kv_read_bytes"]
    memory_s = moved / (bw * 1e9)
    compute_s = model["flops"] / (peak * 1e9)
    linear_gflops = _gflops(model["layer_linear_flops"], parts.get("linear"))
    return {
        "step_ms": _ms(step_s),
        "parts_ms": {k: _ms(v) for k, v in parts.items()},
        "parts_share": {k: round(v / step_s, 3) for k, v in parts.items()},
        "model": {k: round(v, 1) for k, v in model.items()},
        "memory_bound_ms": _ms(memory_s),
        "compute_bound_ms": _ms(compute_s),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "roofline_fraction": round(max(memory_s, compute_s) / step_s, 3),
        "kv_ideal_ms": _ms(model["kv_read_bytes"] / (bw * 1e9)),
        "linear_gflops": linear_gflops,
        "lm_head_gflops": _gflops(model["lm_head_flops"], parts.get("lm_head")),
        "linear_share_of_peak": round(linear_gflops / peak, 3),
    }


def run_roofline(opts: RooflineOptions) -> dict[str, Any]:
    from bench.gpu.engine_throughput import engine_requests

    model_dir, mc = resolve_model(opts.model)
    core = engine_core(
        model_dir, dtype=opts.dtype, max_num_seqs=opts.num_seqs,
        max_loras=max(opts.num_adapters, 1), max_lora_rank=max(opts.rank, 16),
        enable_prefix_caching=False,
    )
    report = report_header("roofline", opts)
    dtype = core.runner.dtype
    peak = matmul_peak_gflops(dtype=dtype)
    bandwidth = memory_bandwidth_gbs()
    bw = max(bandwidth.values())
    shown_bandwidth = {k: round(v, 2) for k, v in bandwidth.items()}
    print_row("machine", {"dtype": dtype_name(dtype), "matmul_gflops": round(peak, 1),
                          **{f"{k}_gb_s": v for k, v in shown_bandwidth.items()}})
    adapters = make_adapters(
        ADAPTER_ROOT, mc, opts.num_adapters, rank=opts.rank, targets=opts.targets
    )
    for name, path in adapters.items():
        core.add_adapter(name, path)
    rng = random.Random(opts.seed)
    prompts = [random_token_ids(rng, rng.randint(*opts.context_len), mc.vocab_size)
               for _ in range(opts.num_seqs)]
    names = list(adapters)
    scenarios: dict[str, list[str | None]] = {"base": [None] * opts.num_seqs}
    if names:
        scenarios["lora"] = [names[i % len(names)] for i in range(opts.num_seqs)]
    # Enough that none finishes while the others' prefills run; all are aborted after.
    compared_steps = 2 * opts.steps * (int(opts.compare_gather) + int(opts.compare_cpu_ops))
    max_tokens = 4 * (opts.steps + compared_steps + opts.profiled_steps) + 64
    runs: dict[str, list[float]] = {name: [] for name in scenarios}
    results: dict[str, dict[str, Any]] = {}
    for round_index in range(opts.repeats):
        for name, loras in scenarios.items():
            workload = [BenchRequest(p, max_tokens, a) for p, a in zip(prompts, loras, strict=True)]
            requests = engine_requests(workload, f"{name}{round_index}", ignore_eos=True)
            _prefill(core, requests)
            core.step()  # the first all-decode step after the prefills
            step_s = statistics.median(_seconds(core.step) for _ in range(opts.steps))
            runs[name].append(step_s)
            model = step_model(core, len(set(a for a in loras if a)))
            parts = profile_parts(core, opts.profiled_steps)
            compared: dict[str, dict[str, float]] = {}
            if opts.compare_gather:
                compared["kernel_vs_gather_step_ms"] = compare_gather(core, opts.steps)
            if opts.compare_cpu_ops:
                compared["fused_vs_torch_step_ms"] = compare_cpu_ops(core, opts.steps)
            for r in requests:
                core.abort_request(r.request_id)
            if step_s > min(runs[name]) and name in results:
                continue
            results[name] = {**_figures(step_s, parts, model, peak, bw), **compared}
            print_row(f"{name} #{round_index}",
                      {k: results[name][k] for k in ("step_ms", "roofline_fraction")})
    report["options"].update(dtype=dtype_name(dtype), fast_paths=core.runner.fast_paths(),
                             threads=torch.get_num_threads())
    report["matmul_peak_gflops"] = round(peak, 1)
    report["bandwidth_gb_s"] = shown_bandwidth
    report["step_ms_runs"] = {k: [_ms(v) for v in vs] for k, vs in runs.items()}
    report["decode"] = results
    for name, result in results.items():
        print(f"{name}: {json.dumps(result['parts_ms'])}", flush=True)
    write_report(report, opts.output)
    return report
