"""An in-process `EngineCore` driven on token-id requests (tests/gpu/test_engine_identity.py
checks it against Hugging Face), and the GPU check's throughput steps on one random model:
the engine against HF static batches, multi-LoRA against PEFT's mixed batches
(`adapter_names`), LoRA overhead per step, and decode step time."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.gpu.models import build_random_model
from bench.harness.adapters import ATTENTION, write_random_adapter
from bench.harness.workload import BenchRequest, make_requests
from bench.hf_baseline import HFResult, load_peft, run_static_batches
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models.loader import load_model_config
from engine.request import EngineRequest, SamplingParams

if TYPE_CHECKING:
    from bench.gpu.models import ThroughputPlan


def make_core(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    max_num_seqs: int,
    max_loras: int,
    max_lora_rank: int,
    kv_cache_tokens: int | None,
    data_dir: Path,
    quantization: str = "none",
) -> EngineCore:
    """kv_cache_tokens None: the engine sizes its cache from the device (on CUDA a share of
    the memory free after loading the weights, see engine/core/model_runner.py)."""
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            device=str(device),
            dtype=_dtype_name(dtype),
            max_num_seqs=max_num_seqs,
            kv_cache_tokens=kv_cache_tokens,
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, 1),
            max_lora_rank=max_lora_rank,
            data_dir=data_dir,
            quantization=quantization,
        )
    )


def close_core(core: EngineCore) -> None:
    """Stop the engine's adapter loader, which would otherwise keep it (and its KV cache)
    alive after the caller drops it."""
    if core.adapter_cache is not None:
        core.adapter_cache.close()


@dataclass(slots=True)
class EngineRun:
    """Requests run to completion: their output tokens, wall time and steps."""

    tokens: dict[str, list[int]]
    wall_s: float
    num_steps: int

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_step_s(self) -> float:
        return self.wall_s / max(self.num_steps, 1)

    def summary(self) -> dict[str, float | int]:
        return {
            "requests": len(self.tokens),
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "steps": self.num_steps,
            "mean_step_ms": round(self.mean_step_s * 1000, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
        }


def engine_requests(
    requests: Sequence[BenchRequest], tag: str, *, ignore_eos: bool
) -> list[EngineRequest]:
    """Greedy engine requests; the tag is each one's prefix-cache salt, so that runs of
    the same prompts never reuse each other's KV."""
    return [
        EngineRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=tuple(r.prompt_token_ids),
            sampling=SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=ignore_eos),
            adapter=r.model,
            salt=tag,
        )
        for i, r in enumerate(requests)
    ]


def run_engine(core: EngineCore, requests: list[EngineRequest]) -> EngineRun:
    """All requests added at once, stepped until every one has finished."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    steps = 0
    while core.has_unfinished_requests():
        result = core.step()
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
        if result.failures:
            request_id, exc = next(iter(result.failures.items()))
            raise RuntimeError(f"engine request {request_id} failed: {exc}") from exc
    return EngineRun(tokens, time.perf_counter() - start, steps)


# ---------------------------------------------------------------------------- throughput


def _gib(num_bytes: float) -> float:
    return round(num_bytes / 2**30, 2)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BenchModel:
    """The throughput model built once: the HF model, the engine over the same weights
    (KV sized by the engine itself), and rank-`lora_rank` adapters loaded into both."""

    def __init__(self, plan: ThroughputPlan, device: torch.device, work_dir: Path) -> None:
        self.timings: dict[str, float] = {}
        self.model_dir = work_dir / plan.shape.name
        start = time.perf_counter()
        self.hf: Any = build_random_model(
            plan.shape, self.model_dir, device=device, dtype=plan.dtype, seed=2
        )
        self.timings["build_and_save_s"] = time.perf_counter() - start
        config = load_model_config(self.model_dir)
        start = time.perf_counter()
        self.adapters = {
            f"lora-{i}": write_random_adapter(
                work_dir / "bench-adapters" / f"lora-{i}",
                config,
                rank=plan.lora_rank,
                alpha=2 * plan.lora_rank,
                targets=ATTENTION,
                seed=200 + i,
            )
            for i in range(max(*plan.adapter_counts, plan.overhead_adapters))
        }
        self.timings["write_adapters_s"] = time.perf_counter() - start
        free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        start = time.perf_counter()
        self.core: EngineCore = make_core(
            self.model_dir,
            device,
            plan.dtype,
            max_num_seqs=max(*plan.concurrency, plan.lora_requests, *plan.decode_batch_sizes),
            max_loras=len(self.adapters),
            max_lora_rank=plan.lora_rank,
            kv_cache_tokens=None,
            data_dir=work_dir,
        )
        self.timings["engine_load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for name, path in self.adapters.items():
            self.core.add_adapter(name, path)
        self.timings["engine_add_adapters_s"] = time.perf_counter() - start
        runner = self.core.runner
        self.kv = {
            "setting": (
                "kv_cache_tokens unset: the cache takes what a profiled largest step leaves "
                f"of gpu_memory_utilization={runner.config.gpu_memory_utilization} "
                "of the device's total memory (CPU: a fixed cap)"
            ),
            "num_blocks": runner.num_blocks,
            "block_size": runner.block_size,
            "tokens": runner.num_blocks * runner.block_size,
            "bytes_per_token": runner.kv_bytes_per_token,
            "gib": _gib(runner.num_blocks * runner.block_size * runner.kv_bytes_per_token),
            "max_model_len": runner.max_model_len,
            "free_gib_before_engine": None if free_before is None else _gib(free_before),
            "hf_model_resident": True,
        }
        self.peft: Any = None

    def wrap_peft(self, dtype: torch.dtype) -> Any:
        """The HF model under PEFT with every adapter (once; HF base runs come first)."""
        if self.peft is None:
            start = time.perf_counter()
            self.peft = load_peft(self.hf, self.adapters)
            self.peft.to(dtype)  # PEFT keeps adapters in float32 on a 16-bit base otherwise
            self.timings["peft_load_adapters_s"] = time.perf_counter() - start
        return self.peft

    def close(self) -> None:
        if self.core is not None:
            close_core(self.core)
        self.core = None  # type: ignore[assignment]
        self.hf = self.peft = None


def _workload(
    n: int,
    vocab: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    models: Sequence[str | None] = (None,),
) -> list[BenchRequest]:
    """Random prompts (bench/harness/workload.py), request i on models[i % len(models)]
    (None: the base model)."""
    reqs = make_requests(
        n, vocab_size=vocab, prompt_len=prompt_len, output_len=output_len, seed=seed
    )
    return [replace(r, model=models[i % len(models)]) for i, r in enumerate(reqs)]


def _pair(engine: EngineRun, baseline: HFResult) -> dict[str, Any]:
    return {
        "engine": engine.summary(),
        "baseline": baseline.summary(),
        "engine_vs_baseline": round(engine.output_tokens_per_s / baseline.output_tokens_per_s, 2),
    }


def check_throughput(plan: ThroughputPlan, bench: BenchModel) -> dict[str, Any]:
    core, vocab = bench.core, plan.shape.vocab_size
    names = list(bench.adapters)
    results: dict[str, Any] = {
        "model": plan.shape.name,
        "num_params": plan.shape.num_params,
        "dtype": _dtype_name(plan.dtype),
        "kv_cache": bench.kv,
    }

    # Warm-up: prefill segments of every row-block size, decodes, base rows, and every
    # adapter once, so that the timed runs find all of them in their device slots.
    warm = _workload(8, vocab, (20, 100), (4, 4), 99, [None, *names])
    run_engine(core, engine_requests(warm, "warm", ignore_eos=True))
    every_adapter = _workload(len(names), vocab, (8, 8), (2, 2), 98, names)
    run_engine(core, engine_requests(every_adapter, "warm-adapters", ignore_eos=True))
    run_static_batches(bench.hf, warm[:2], 2)

    base: dict[str, Any] = {}
    base_runs: dict[int, EngineRun] = {}
    for c in plan.concurrency:
        reqs = _workload(c, vocab, plan.prompt_len, plan.output_len, seed=c)
        base_runs[c] = run_engine(core, engine_requests(reqs, f"base{c}", ignore_eos=True))
        hf = run_static_batches(bench.hf, reqs, min(c, plan.hf_batch_size))
        base[str(c)] = _pair(base_runs[c], hf)
        print(f"base x{c}: {base[str(c)]}", flush=True)
    results["engine_vs_hf_static"] = base

    # LoRA overhead: the first base workload again, every row on a rank-r adapter.
    c0 = plan.concurrency[0]
    overhead = names[: plan.overhead_adapters]
    reqs = _workload(c0, vocab, plan.prompt_len, plan.output_len, c0, overhead)
    lora_run = run_engine(core, engine_requests(reqs, f"overhead{c0}", ignore_eos=True))
    ratio = lora_run.mean_step_s / base_runs[c0].mean_step_s
    results["lora_overhead"] = {
        "sequences": c0,
        "adapters": plan.overhead_adapters,
        "rank": plan.lora_rank,
        "base": base_runs[c0].summary(),
        "lora": lora_run.summary(),
        "lora_vs_base_step_time": round(ratio, 3),
    }
    print(f"lora overhead: {results['lora_overhead']}", flush=True)

    peft = bench.wrap_peft(plan.dtype)
    run_static_batches(peft, [BenchRequest(warm[1].prompt_token_ids, 2, names[0])], 1, peft=True)
    multi: dict[str, Any] = {}
    for n in plan.adapter_counts:
        reqs = _workload(
            plan.lora_requests, vocab, plan.lora_prompt_len, plan.lora_output_len, 1000 + n,
            names[:n],
        )
        run = run_engine(core, engine_requests(reqs, f"lora{n}", ignore_eos=True))
        peft_run = run_static_batches(peft, reqs, plan.hf_batch_size, peft=True)
        multi[str(n)] = {"adapters": n, **_pair(run, peft_run)}
        print(f"multi-lora x{n}: {multi[str(n)]}", flush=True)
    results["engine_vs_peft_adapter_names"] = multi
    results["setup_s"] = {k: round(v, 2) for k, v in bench.timings.items()}
    return results


def time_decode_steps(core: EngineCore, plan: ThroughputPlan, n: int, label: str,
                      models: Sequence[str | None] = (None,)) -> dict[str, Any]:
    """Eager decode step times with `n` sequences (request i on models[i % len(models)]),
    after their prefills; the requests are aborted after the timed steps."""
    prompt_len = (plan.decode_prompt_len, plan.decode_prompt_len)
    # Far more tokens than are timed: no sequence finishes inside the timed steps (the
    # first ones decode while the last prefills run); the rest is aborted.
    output_len = (plan.decode_timed_steps + 256, plan.decode_timed_steps + 256)
    reqs = _workload(n, plan.shape.vocab_size, prompt_len, output_len, 7 + n, models)
    requests = engine_requests(reqs, label, ignore_eos=True)
    for request in requests:
        core.add_request(request)
    started: set[str] = set()
    while len(started) < n:  # prefills (and the first decodes they allow)
        started.update(out.request_id for out in core.step().outputs)
    times: list[float] = []
    for _ in range(plan.decode_timed_steps):
        start = time.perf_counter()
        outs = core.step().outputs
        times.append(time.perf_counter() - start)
        assert len(outs) == n, f"a decode step ran {len(outs)} of {n} sequences"
    for request in requests:
        core.abort_request(request.request_id)
    assert not core.has_unfinished_requests()
    median = statistics.median(times)
    return {
        "sequences": n,
        "eager_step_ms_median": round(median * 1000, 3),
        "eager_step_ms_min": round(min(times) * 1000, 3),
        "decode_tok_s": round(n / median, 1),
    }


def check_decode_steps(plan: ThroughputPlan, bench: BenchModel) -> dict[str, Any]:
    """Decode-only step time at each batch size. The engine has no CUDA graph capture,
    so only eager steps are timed."""
    rows: dict[str, Any] = {}
    for n in plan.decode_batch_sizes:
        rows[str(n)] = {**time_decode_steps(bench.core, plan, n, f"decode{n}"),
                        "cuda_graphs_step_ms": None}
    return {"cuda_graphs": "not implemented", "decode": rows, "model": plan.shape.name}


def quantized_schemes(device: torch.device) -> list[str]:
    """The schemes a device serves: int8 and int4, and fp8 from compute capability 8.9."""
    schemes = ["int8", "int4"]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        schemes.append("fp8")
    return schemes


def check_quantized_decode(plan: ThroughputPlan, bench: BenchModel, device: torch.device,
                           deadline: float = float("inf")) -> dict[str, Any]:
    """Each quantized scheme against the unquantized engine on the same weights: load
    time, weight bytes, decode step time at each batch size on the base model and with
    every row on one of `overhead_adapters` adapters, and how many of 4 greedy
    continuations of 16 tokens equal the unquantized engine's. No scheme is started past
    `deadline` (time.perf_counter()); those are listed under "not_run"."""
    names = list(bench.adapters)[: plan.overhead_adapters]
    sizes = plan.decode_batch_sizes

    def decode(core: EngineCore, label: str) -> dict[str, Any]:
        return {
            "base": {str(n): time_decode_steps(core, plan, n, f"{label}-b{n}") for n in sizes},
            "adapters": {str(n): time_decode_steps(core, plan, n, f"{label}-a{n}", names)
                         for n in sizes},
        }

    probe = _workload(4, plan.shape.vocab_size, (16, 32), (16, 16), 4242, [None, names[0]])

    def greedy(core: EngineCore, label: str) -> list[list[int]]:
        return list(run_engine(core, engine_requests(probe, label, ignore_eos=True))
                    .tokens.values())

    reference_tokens = greedy(bench.core, "q-ref")
    results: dict[str, Any] = {
        _dtype_name(plan.dtype): {"weight_bytes": bench.core.runner.weight_bytes,
                                  "decode": decode(bench.core, "unquantized")},
    }
    # NOTE: the unquantized engine's KV cache took what its profile left of the device
    # (with the HF model resident): both go before the quantized engines load. This is
    # the check's last step; the throughput model is closed for good.
    bench.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    schemes: list[str] = []
    not_run: list[str] = []
    for scheme in quantized_schemes(device):
        if time.perf_counter() > deadline:
            not_run.append(scheme)
            continue
        schemes.append(scheme)
        start = time.perf_counter()
        core = make_core(bench.model_dir, device, plan.dtype,
                         max_num_seqs=max(sizes), max_loras=len(names),
                         max_lora_rank=plan.lora_rank,
                         kv_cache_tokens=max(sizes) * (plan.decode_prompt_len
                                                       + plan.decode_timed_steps + 288),
                         data_dir=bench.model_dir.parent, quantization=scheme)
        load_s = time.perf_counter() - start
        try:
            for name in names:
                core.add_adapter(name, bench.adapters[name])
            tokens = greedy(core, f"q-{scheme}")
            results[scheme] = {
                "load_s": round(load_s, 2),
                "weight_bytes": core.runner.weight_bytes,
                "greedy_equal_of_4": sum(a == b for a, b in zip(tokens, reference_tokens,
                                                                strict=True)),
                "decode": decode(core, scheme),
            }
        finally:
            close_core(core)
            del core
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"quantized {scheme}: {results[scheme]}", flush=True)
    base = results[_dtype_name(plan.dtype)]
    for scheme in schemes:
        r = results[scheme]
        r["weight_bytes_vs_unquantized"] = round(r["weight_bytes"] / base["weight_bytes"], 3)
        r["decode_tok_s_vs_unquantized"] = {
            mix: {n: round(r["decode"][mix][n]["decode_tok_s"]
                           / base["decode"][mix][n]["decode_tok_s"], 3) for n in r["decode"][mix]}
            for mix in ("base", "adapters")
        }
    return {"model": plan.shape.name, "dtype": _dtype_name(plan.dtype), "schemes": schemes,
            "not_run": not_run, **results}
