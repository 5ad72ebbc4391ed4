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

import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness.options import internal, opt
from bench.harness.report import machine_description, print_row, write_report
from engine.config import EngineConfig, default_data_dir
from engine.core.model_runner import dtype_name
from engine.models.loader import load_model_config, resolve_model_dir


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


def _best_seconds(fn: Callable[[], object], iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak_gflops(n: int = 2048, iters: int = 5, dtype: torch.dtype = torch.float32
                       ) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), iters)
    return 2 * n**3 / seconds / 1e9


def memory_bandwidth_gbs(mib: int = 512, iters: int = 5) -> dict[str, float]:
    """copy: bytes read + written per second; read: a sum's bytes read per second."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy_s = _best_seconds(lambda: dst.copy_(src), iters)
    read_s = _best_seconds(lambda: src.sum(), iters)
    return {"copy": 2 * nbytes / copy_s / 1e9, "read": nbytes / read_s / 1e9}


# ---------------------------------------------------------------------------- breakdown

# Scopes the profiled steps are wrapped in (see _scoped); ops outside every scope are
# classified by name.
_SCOPES = ("prepare_inputs", "lora", "attention", "norms", "rope", "lm_head", "sampling",
           "activation")
# A scope's own time (outside the ops inside it: the C kernels' calls, and Python) counts
# to this part; the attention scope's is mostly the K/V write's C call.
_SCOPE_SELF_PART = {"attention": "kv_write", "lora": "lora", "norms": "norms", "rope": "rope",
                    "activation": "activation", "lm_head": "lm_head", "sampling": "sampling"}
_KERNEL_SCOPE = "decode_kernel"
# The AMX linear kernel's C call (loraplex_kernels/cpu_amx.py): the linear layers' part,
# or the lm_head's when the output projection runs it. Its gate_up call with the SiLU in
# it (linear_silu_mul) counts to linear too: the weight read is nearly all of it.
_AMX_SCOPE = "amx_linear"


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


@contextmanager
def _scoped(core: Any) -> Iterator[None]:
    """Wrap the engine's parts in profiler scopes (instance and module attributes),
    restoring them afterwards."""
    import engine.models.llama as llama
    from engine.core.model_runner import ModelRunner
    from engine.lora.layers import LoRAGroup

    def scope(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapped

    patches: list[tuple[Any, str, Any]] = [
        (ModelRunner, "prepare_inputs", ModelRunner.prepare_inputs),
        (LoRAGroup, "apply", LoRAGroup.apply),
        (llama, "paged_attention", llama.paged_attention),
        (llama.RMSNorm, "forward", llama.RMSNorm.forward),
        (llama.RMSNorm, "add_forward", llama.RMSNorm.add_forward),
        (llama.LlamaAttention, "rope_qk", llama.LlamaAttention.rope_qk),
        (core.runner.model, "compute_logits", core.runner.model.compute_logits),
        (core, "sampler", core.sampler),
    ]
    names = ["prepare_inputs", "lora", "attention", "norms", "norms", "rope", "lm_head",
             "sampling"]
    from loraplex_kernels import cpu_ops

    patches.append((cpu_ops, "silu_mul", cpu_ops.silu_mul))
    names.append("activation")
    from loraplex_kernels import cpu_amx

    patches.append((cpu_amx, "linear", cpu_amx.linear))
    names.append(_AMX_SCOPE)
    patches.append((cpu_amx, "linear_silu_mul", cpu_amx.linear_silu_mul))
    names.append(_AMX_SCOPE)
    try:  # trees without the CPU decode kernel profile without it
        from loraplex_kernels import cpu_decode

        patches.append(
            (cpu_decode, "paged_decode_attention", cpu_decode.paged_decode_attention)
        )
        names.append(_KERNEL_SCOPE)
    except ImportError:
        pass
    for (owner, attr, original), name in zip(patches, names, strict=True):
        setattr(owner, attr, scope(name, original))
    try:
        yield
    finally:
        for owner, attr, original in patches:
            setattr(owner, attr, original)


def profile_parts(core: Any, steps: int) -> dict[str, float]:
    """Mean op self time per step by part, in seconds."""
    from torch.profiler import ProfilerActivity, profile

    with _scoped(core), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    parts: dict[str, float] = {}
    for event in prof.events():
        if event.name == _KERNEL_SCOPE:  # a C call, not an op: its own time counts
            parts["decode_attention"] = (
                parts.get("decode_attention", 0.0) + event.self_cpu_time_total / 1e6
            )
            continue
        if event.name == _AMX_SCOPE:
            outer = event.cpu_parent
            amx_part = "lm_head" if outer is not None and outer.name == "lm_head" else "linear"
            parts[amx_part] = parts.get(amx_part, 0.0) + event.self_cpu_time_total / 1e6
            continue
        if event.name in _SCOPES:
            part = _SCOPE_SELF_PART.get(event.name)
            if part is not None and (event.cpu_parent is None
                                     or event.cpu_parent.name not in _SCOPES):
                parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e6
            continue
        if event.name.startswith("ProfilerStep"):
            continue
        parent = event.cpu_parent
        # Only outermost ops: a nested op's time is inside its parent op's.
        if parent is not None and parent.name not in _SCOPES:
            continue
        part = _op_part(event.name, None if parent is None else parent.name)
        parts[part] = parts.get(part, 0.0) + event.cpu_time_total / 1e6
    return {k: v / steps for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


# ---------------------------------------------------------------------------- the step


def _requests(
    tag: str, prompts: list[list[int]], adapters: list[str | None], max_tokens: int
) -> list[Any]:
    from engine.request import EngineRequest, SamplingParams

    return [
        EngineRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=tuple(p),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            adapter=a,
            salt=tag,
        )
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]


def _prefill(core: Any, requests: list[Any]) -> None:
    """Queue the requests and step until every one is decoding."""
    for r in requests:
        core.add_request(r)
    started: set[str] = set()
    while len(started) < len(requests):
        for out in core.step().outputs:
            started.add(out.request_id)


def step_model(core: Any, adapters: list[str | None], num_adapters: int) -> dict[str, float]:
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
    # Every parameter read once (a tied embedding matrix: as the output projection).
    weight_bytes = model_cls.count_parameters(cfg) * itemsize
    lora_bytes = 0.0
    lora_flops = 0.0
    if runner.lora is not None and num_adapters:
        for by_name in runner.lora.groups:
            for group in by_name.values():
                for packed in group.packed:
                    if packed is not None:
                        n = packed.num_elements
                        lora_bytes += n * itemsize
                        lora_flops += 2 * n * num_seqs / num_adapters
    kv_bytes = context * runner.kv_bytes_per_token
    attn_flops = 4 * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return {
        "num_seqs": num_seqs,
        "mean_context": context / max(num_seqs, 1),
        "weight_bytes": weight_bytes,
        "lora_bytes": lora_bytes,
        "kv_read_bytes": kv_bytes,
        "flops": 2 * num_seqs * linear_params + attn_flops + lora_flops,
        "attention_flops": attn_flops,
        "layer_linear_flops": 2 * num_seqs * layer_params * cfg.num_layers,
        "lm_head_flops": 2 * num_seqs * head_params,
    }


def _alternate(
    core: Any, steps: int, labels: tuple[str, str], switch: Callable[[str], None]
) -> dict[str, float]:
    """Median step time under each of two settings, alternating step by step on the same
    batch (the order flips every pair)."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    for i in range(steps):
        for label in labels if i % 2 == 0 else labels[::-1]:
            switch(label)
            start = time.perf_counter()
            core.step()
            times[label].append(time.perf_counter() - start)
    return {k: round(statistics.median(v) * 1000, 2) for k, v in times.items()}


def compare_gather(core: Any, steps: int) -> dict[str, float]:
    """Decode attention on the kernel and on the gather path."""
    from loraplex_kernels import cpu_decode

    real = cpu_decode.available

    def switch(label: str) -> None:
        cpu_decode.available = real if label == "kernel" else _never

    try:
        return _alternate(core, steps, ("kernel", "gather"), switch)
    finally:
        cpu_decode.available = real


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

    try:
        return _alternate(core, steps, ("fused", "torch"), switch)
    finally:
        switch("fused")
        cpu_ops.available = real


def _never(device: torch.device, dtype: torch.dtype) -> bool:
    return False


def _gflops(flops: float, seconds: float | None) -> float:
    return round(flops / seconds / 1e9, 1) if seconds else 0.0


def run_roofline(opts: RooflineOptions) -> dict[str, Any]:
    from bench.lora import make_adapters
    from engine.core.engine_core import EngineCore

    model_dir = resolve_model_dir(opts.model, default_data_dir())
    mc = load_model_config(model_dir)
    core = EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype=opts.dtype,
            max_num_seqs=opts.num_seqs,
            max_loras=max(opts.num_adapters, 1),
            max_lora_rank=max(opts.rank, 16),
            enable_prefix_caching=False,
        )
    )
    dtype = core.runner.dtype
    peak = matmul_peak_gflops(dtype=dtype)
    bandwidth = memory_bandwidth_gbs()
    bw = max(bandwidth.values())
    print_row("machine", {"dtype": dtype_name(dtype),
                          "matmul_gflops": round(peak, 1), **{
        f"{k}_gb_s": round(v, 2) for k, v in bandwidth.items()}})
    adapter_names: list[str] = []
    if opts.num_adapters:
        paths = make_adapters(
            Path("bench/results/adapters"), mc, opts.num_adapters, rank=opts.rank,
            targets=opts.targets,
        )
        for name, path in paths.items():
            core.add_adapter(name, path)
        adapter_names = list(paths)
    rng = random.Random(opts.seed)
    low = min(1000, mc.vocab_size // 4)
    prompts = [
        [rng.randrange(low, mc.vocab_size) for _ in range(rng.randint(*opts.context_len))]
        for _ in range(opts.num_seqs)
    ]
    scenarios: dict[str, list[str | None]] = {"base": [None] * opts.num_seqs}
    if adapter_names:
        scenarios["lora"] = [adapter_names[i % len(adapter_names)] for i in range(opts.num_seqs)]
    # Enough that none finishes while the others' prefills run; all are aborted after.
    compared_steps = 2 * opts.steps * (int(opts.compare_gather) + int(opts.compare_cpu_ops))
    max_tokens = 4 * (opts.steps + compared_steps + opts.profiled_steps) + 64
    runs: dict[str, list[float]] = {name: [] for name in scenarios}
    results: dict[str, dict[str, Any]] = {}
    for round_index in range(opts.repeats):
        for name, adapters in scenarios.items():
            tag = f"{name}{round_index}"
            requests = _requests(tag, prompts, adapters, max_tokens)
            _prefill(core, requests)
            core.step()  # the first all-decode step after the prefills
            times: list[float] = []
            for _ in range(opts.steps):
                start = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - start)
            step_s = statistics.median(times)
            runs[name].append(step_s)
            model = step_model(core, adapters, len(set(a for a in adapters if a)))
            parts = profile_parts(core, opts.profiled_steps)
            compared = compare_gather(core, opts.steps) if opts.compare_gather else None
            fused = compare_cpu_ops(core, opts.steps) if opts.compare_cpu_ops else None
            for r in requests:
                core.abort_request(r.request_id)
            if step_s > min(runs[name]) and name in results:
                continue
            ops = sum(parts.values())
            parts["python"] = max(step_s - ops, 0.0)
            moved = model["weight_bytes"] + model["lora_bytes"] + model["kv_read_bytes"]
            memory_s = moved / (bw * 1e9)
            compute_s = model["flops"] / (peak * 1e9)
            bound_s = max(memory_s, compute_s)
            linear_gflops = _gflops(model["layer_linear_flops"], parts.get("linear"))
            results[name] = {
                "step_ms": round(step_s * 1000, 2),
                "parts_ms": {k: round(v * 1000, 2) for k, v in parts.items()},
                "parts_share": {k: round(v / step_s, 3) for k, v in parts.items()},
                "model": {k: round(v, 1) for k, v in model.items()},
                "memory_bound_ms": round(memory_s * 1000, 2),
                "compute_bound_ms": round(compute_s * 1000, 2),
                "bound": "memory" if memory_s >= compute_s else "compute",
                "roofline_fraction": round(bound_s / step_s, 3),
                "kv_ideal_ms": round(model["kv_read_bytes"] / (bw * 1e9) * 1000, 2),
                "linear_gflops": linear_gflops,
                "lm_head_gflops": _gflops(model["lm_head_flops"], parts.get("lm_head")),
                "linear_share_of_peak": round(linear_gflops / peak, 3),
            }
            if compared is not None:
                results[name]["kernel_vs_gather_step_ms"] = compared
            if fused is not None:
                results[name]["fused_vs_torch_step_ms"] = fused
            print_row(f"{name} #{round_index}", {
                "step_ms": round(step_s * 1000, 2),
                "roofline_fraction": results[name]["roofline_fraction"],
            })
    report: dict[str, Any] = {
        "benchmark": "roofline",
        "machine": machine_description(),
        "options": {
            "num_seqs": opts.num_seqs, "context_len": list(opts.context_len),
            "num_adapters": opts.num_adapters, "rank": opts.rank, "targets": opts.targets,
            "dtype": dtype_name(dtype), "fast_paths": core.runner.fast_paths(),
            "steps": opts.steps, "repeats": opts.repeats, "threads": torch.get_num_threads(),
            "compare_gather": opts.compare_gather, "compare_cpu_ops": opts.compare_cpu_ops,
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "matmul_peak_gflops": round(peak, 1),
        "bandwidth_gb_s": {k: round(v, 2) for k, v in bandwidth.items()},
        "step_ms_runs": {k: [round(v * 1000, 2) for v in vs] for k, vs in runs.items()},
        "decode": results,
    }
    for name, result in results.items():
        print(f"{name}: {json.dumps(result['parts_ms'])}", flush=True)
    write_report(report, opts.output)
    return report
