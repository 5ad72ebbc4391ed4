"""Multi-LoRA benchmarks: adapter scaling, against Hugging Face PEFT, LoRA overhead per
step, and cold adapter loads. Every figure comes with its baseline measured in the same
run; docs/BENCHMARKS.md records the ratios.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.adapters import ALL_LINEAR, ATTENTION, write_random_adapter
from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.harness.server import model_name, running_server
from bench.harness.workload import BenchRequest, LoadResult, make_requests, percentile, run_load
from bench.hf_baseline import HFResult, load_hf_model, run_one_at_a_time, run_static_batches
from engine.config import EngineConfig, default_data_dir
from engine.models.loader import ModelConfig, load_model_config, resolve_model_dir

TARGET_SETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "attention": ATTENTION,
    "all-linear": ALL_LINEAR,
}


@dataclass(slots=True)
class LoRABenchOptions:
    model: str = "default"
    num_adapters: int = 32
    num_requests: int = 32
    rank: int = 16
    targets: str = opt("attention", choices=("qv", "attention", "all-linear"))
    prompt_len: tuple[int, int] = opt((32, 256), "min-max tokens")
    output_len: tuple[int, int] = opt((64, 128), "min-max tokens")
    zipf_alpha: float = 1.0
    seed: int = 0
    repeats: int = opt(2, "alternating rounds")
    # Streams (per-token SSE) cost the load generator, which shares the CPU with the
    # server here; throughput figures use plain responses unless asked.
    stream: bool = opt(False, "send requests as SSE streams (TTFT/TPOT figures, more client work)")
    hf_batch_size: int = 8  # lora-vs-peft
    loads: int = 20  # lora-cold-load
    serve_args: list[str] = opt([], "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = None


# ---------------------------------------------------------------------------- helpers


def _model(opts: LoRABenchOptions) -> tuple[Path, ModelConfig]:
    model_dir = resolve_model_dir(opts.model, default_data_dir())
    return model_dir, load_model_config(model_dir)


def make_adapters(
    root: Path, config: ModelConfig, count: int, *, rank: int, targets: str, seed: int = 0
) -> dict[str, Path]:
    """`count` random adapters named lora-0 .. lora-{count-1}, written once under root."""
    folder = root / f"{targets}-r{rank}-s{seed}"
    adapters: dict[str, Path] = {}
    for i in range(count):
        path = folder / f"lora-{i}"
        if not (path / "adapter_config.json").exists():
            write_random_adapter(
                path,
                config,
                rank=rank,
                alpha=2 * rank,
                targets=TARGET_SETS[targets],
                seed=seed * 100_000 + i,
            )
        adapters[f"lora-{i}"] = path
    return adapters


def zipf_choices(names: Sequence[str], n: int, alpha: float, seed: int) -> list[str]:
    """n draws from names with P(i) proportional to 1 / (i + 1) ** alpha."""
    weights = [1.0 / (i + 1) ** alpha for i in range(len(names))]
    return random.Random(seed).choices(list(names), weights=weights, k=n)


def _with_models(requests: list[BenchRequest], models: Sequence[str | None]) -> list[BenchRequest]:
    return [
        BenchRequest(prompt_token_ids=r.prompt_token_ids, max_tokens=r.max_tokens, model=m)
        for r, m in zip(requests, models, strict=True)
    ]


def _lora_flags(adapters: dict[str, Path]) -> list[str]:
    return [flag for name, path in adapters.items() for flag in ("--lora", f"{name}={path}")]


def _adapter_root() -> Path:
    return Path("bench/results/adapters")


# ---------------------------------------------------------------------------- scaling


def run_scaling(opts: LoRABenchOptions) -> dict[str, Any]:
    """N concurrent requests all on one adapter vs on N distinct adapters (uniform) vs
    Zipf popularity over the same N adapters; one server, rounds alternate."""
    _, config = _model(opts)
    adapters = make_adapters(
        _adapter_root(), config, opts.num_adapters, rank=opts.rank, targets=opts.targets
    )
    names = list(adapters)
    base_requests = make_requests(
        opts.num_requests,
        vocab_size=config.vocab_size,
        prompt_len=opts.prompt_len,
        output_len=opts.output_len,
        seed=opts.seed,
    )
    mixes: dict[str, list[str | None]] = {
        "single": [names[0]] * opts.num_requests,
        "uniform": [names[i % len(names)] for i in range(opts.num_requests)],
        "zipf": list(zipf_choices(names, opts.num_requests, opts.zipf_alpha, opts.seed)),
    }
    report = report_header("lora_scaling", opts)
    report["distinct_adapters"] = {k: len(set(v)) for k, v in mixes.items()}
    runs: dict[str, list[LoadResult]] = {k: [] for k in mixes}
    # NOTE: no prefix caching: every round sends the same prompts, and a mix whose
    # requests share adapters with an earlier run would otherwise skip their prefills.
    serve = [
        "--model", opts.model,
        "--max-loras", str(opts.num_adapters),
        "--max-num-seqs", str(opts.num_requests),
        "--no-enable-prefix-caching",
        *_lora_flags(adapters),
        *opts.serve_args,
    ]  # fmt: skip
    with running_server(serve) as base_url:
        base_model = model_name(base_url)
        # Warm every adapter into its slot: the steady state is measured, not first loads.
        warm = [BenchRequest(base_requests[0].prompt_token_ids[:8], 2, name) for name in names]
        asyncio.run(run_load(base_url, base_model, warm, len(warm)))
        for round_index in range(opts.repeats):
            # The order rotates every round, so no mix always runs first or last.
            order = list(mixes)
            order = order[round_index % len(order) :] + order[: round_index % len(order)]
            for mix in order:
                models = mixes[mix]
                result = asyncio.run(
                    run_load(
                        base_url,
                        base_model,
                        _with_models(base_requests, models),
                        opts.num_requests,
                        stream=opts.stream,
                    )
                )
                runs[mix].append(result)
                print_row(f"{mix} #{round_index}", result.summary())
    best = {mix: max(rs, key=lambda r: r.output_tokens_per_s) for mix, rs in runs.items()}
    report["best"] = {mix: r.summary() for mix, r in best.items()}
    report["runs"] = {mix: [r.summary() for r in rs] for mix, rs in runs.items()}
    single = best["single"].output_tokens_per_s
    report["ratios"] = {
        "uniform_vs_single": round(best["uniform"].output_tokens_per_s / single, 3),
        "zipf_vs_single": round(best["zipf"].output_tokens_per_s / single, 3),
    }
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- vs PEFT


def load_peft_model(model_dir: Path, adapters: dict[str, Path]) -> Any:
    from bench.gpu.engine_runs import load_peft

    return load_peft(load_hf_model(model_dir), adapters)


def run_vs_peft(opts: LoRABenchOptions) -> dict[str, Any]:
    """num_requests over num_adapters (one each, round robin): the server vs PEFT
    one-at-a-time (set_adapter) and in static mixed batches (adapter_names)."""
    model_dir, config = _model(opts)
    adapters = make_adapters(
        _adapter_root(), config, opts.num_adapters, rank=opts.rank, targets=opts.targets
    )
    names = list(adapters)
    requests = _with_models(
        make_requests(
            opts.num_requests,
            vocab_size=config.vocab_size,
            prompt_len=opts.prompt_len,
            output_len=opts.output_len,
            seed=opts.seed,
        ),
        [names[i % len(names)] for i in range(opts.num_requests)],
    )
    report = report_header("lora_vs_peft", opts)
    serve = [
        "--model", opts.model,
        "--max-loras", str(opts.num_adapters),
        "--max-num-seqs", str(max(opts.num_requests, 1)),
        *_lora_flags(adapters),
        *opts.serve_args,
    ]  # fmt: skip
    engine_runs: list[LoadResult] = []
    single_runs: list[HFResult] = []
    static_runs: list[HFResult] = []
    peft = load_peft_model(model_dir, adapters)
    for round_index in range(opts.repeats):
        with running_server(serve) as base_url:
            base_model = model_name(base_url)
            warm = [BenchRequest(requests[0].prompt_token_ids[:8], 2, name) for name in names]
            asyncio.run(run_load(base_url, base_model, warm, len(warm)))
            engine_runs.append(
                asyncio.run(
                    run_load(base_url, base_model, requests, opts.num_requests, stream=opts.stream)
                )
            )
        print_row(f"engine #{round_index}", engine_runs[-1].summary())
        if round_index == 0:
            warm_peft = [BenchRequest(requests[0].prompt_token_ids[:8], 2, names[0])]
            run_one_at_a_time(peft, warm_peft, peft=True)
        single_runs.append(run_one_at_a_time(peft, requests, peft=True))
        print_row(f"peft one-at-a-time #{round_index}", single_runs[-1].summary())
        static_runs.append(run_static_batches(peft, requests, opts.hf_batch_size, peft=True))
        print_row(f"peft static x{opts.hf_batch_size} #{round_index}", static_runs[-1].summary())
    engine = max(engine_runs, key=lambda r: r.output_tokens_per_s)
    single = max(single_runs, key=lambda r: r.output_tokens_per_s)
    static = max(static_runs, key=lambda r: r.output_tokens_per_s)
    best_peft = max(single, static, key=lambda r: r.output_tokens_per_s)
    report["engine"] = engine.summary()
    report["peft_one_at_a_time"] = single.summary()
    report["peft_static_batches"] = static.summary()
    report["runs"] = {
        "engine": [r.summary() for r in engine_runs],
        "peft_one_at_a_time": [r.summary() for r in single_runs],
        "peft_static_batches": [r.summary() for r in static_runs],
    }
    report["ratios"] = {
        "engine_vs_best_peft": round(engine.output_tokens_per_s / best_peft.output_tokens_per_s, 2),
        "engine_vs_peft_one_at_a_time": round(
            engine.output_tokens_per_s / single.output_tokens_per_s, 2
        ),
        "engine_vs_peft_static": round(engine.output_tokens_per_s / static.output_tokens_per_s, 2),
    }
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- overhead


def _step_time(core: Any, requests: list[Any]) -> tuple[float, int]:
    """Mean seconds per step running `requests` to completion, and the number of steps."""
    for r in requests:
        core.add_request(r)
    steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return (time.perf_counter() - start) / steps, steps


def run_overhead(opts: LoRABenchOptions) -> dict[str, Any]:
    """The same requests on the base model and all on one adapter, in one in-process
    engine (no HTTP): mean step time of each, best of `repeats` alternating rounds."""
    from engine.core.engine_core import EngineCore
    from engine.request import EngineRequest, SamplingParams

    model_dir, config = _model(opts)
    adapters = make_adapters(_adapter_root(), config, 1, rank=opts.rank, targets=opts.targets)
    core = EngineCore(
        EngineConfig(model=str(model_dir), max_num_seqs=opts.num_requests, max_loras=1)
    )
    core.add_adapter("lora-0", adapters["lora-0"])
    workload = make_requests(
        opts.num_requests,
        vocab_size=config.vocab_size,
        prompt_len=opts.prompt_len,
        output_len=opts.output_len,
        seed=opts.seed,
    )

    def requests(tag: str, adapter: str | None) -> list[EngineRequest]:
        return [
            EngineRequest(
                request_id=f"{tag}-{i}",
                prompt_token_ids=tuple(r.prompt_token_ids),
                sampling=SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                adapter=adapter,
                # A distinct salt per round: no prefix-cache hits between rounds.
                salt=tag,
            )
            for i, r in enumerate(workload)
        ]

    report = report_header("lora_overhead", opts)
    _step_time(core, requests("warm", "lora-0")[:2])
    rounds: dict[str, list[float]] = {"base": [], "lora": []}
    steps: dict[str, int] = {}
    for round_index in range(opts.repeats):
        for label, adapter in (("base", None), ("lora", "lora-0")):
            seconds, n = _step_time(core, requests(f"{label}{round_index}", adapter))
            rounds[label].append(seconds)
            steps[label] = n
            print_row(f"{label} #{round_index}", {"step_ms": round(seconds * 1000, 2), "steps": n})
    best = {label: min(values) for label, values in rounds.items()}
    report["steps"] = steps
    report["step_ms"] = {k: [round(v * 1000, 2) for v in vs] for k, vs in rounds.items()}
    report["best_step_ms"] = {k: round(v * 1000, 2) for k, v in best.items()}
    report["ratios"] = {"lora_vs_base_step_time": round(best["lora"] / best["base"], 3)}
    print("best of each:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


# ---------------------------------------------------------------------------- cold load


def run_cold_load(opts: LoRABenchOptions) -> dict[str, Any]:
    """An adapter from disk to ready: read + validate + host copy (add_adapter), then the
    device-slot install its first request pays; PEFT's `load_adapter` of the same files
    on the same machine is the baseline."""
    from engine.core.engine_core import EngineCore
    from engine.request import EngineRequest, SamplingParams

    model_dir, config = _model(opts)
    core = EngineCore(EngineConfig(model=str(model_dir), max_loras=1, max_cpu_loras=1))
    peft = load_peft_model(
        model_dir,
        make_adapters(_adapter_root(), config, 1, rank=opts.rank, targets=opts.targets, seed=9),
    )
    report = report_header("lora_cold_load", opts)
    to_host: list[float] = []
    to_ready: list[float] = []
    peft_load: list[float] = []
    size_bytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.loads):
            # A fresh directory each time, written before the clock starts. NOTE: the page
            # cache still holds it; a load from a cold disk adds the read time of
            # size_bytes.
            path = write_random_adapter(
                Path(tmp) / f"cold-{i}",
                config,
                rank=opts.rank,
                alpha=2 * opts.rank,
                targets=TARGET_SETS[opts.targets],
                seed=1000 + i,
            )
            start = time.perf_counter()
            size_bytes = core.add_adapter(f"cold-{i}", path).size_bytes
            loaded = time.perf_counter()
            core.add_request(
                EngineRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=(1000, 1001),
                    sampling=SamplingParams(max_tokens=1, temperature=0),
                    adapter=f"cold-{i}",
                )
            )
            while core.has_unfinished_requests():
                core.step()  # the first step installs the adapter in a device slot
            assert core.runner.lora is not None
            to_host.append(loaded - start)
            to_ready.append((loaded - start) + core.runner.lora.last_install_s)
            core.remove_adapter(f"cold-{i}")
            start = time.perf_counter()
            peft.load_adapter(str(path), adapter_name=f"cold-{i}")
            peft_load.append(time.perf_counter() - start)
            peft.delete_adapter(f"cold-{i}")
    report["size_bytes"] = size_bytes
    report["add_adapter_s"] = _percentiles(to_host)
    report["disk_to_ready_s"] = _percentiles(to_ready)
    report["peft_load_adapter_s"] = _percentiles(peft_load)
    report["ratios"] = {
        "peft_vs_ours_p50": round(statistics.median(peft_load) / statistics.median(to_ready), 2)
    }
    print_row("add_adapter", report["add_adapter_s"])
    print_row("disk to ready", report["disk_to_ready_s"])
    print_row("peft load_adapter", report["peft_load_adapter_s"])
    write_report(report, opts.output)
    return report


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(percentile(ordered, 50), 4),
        "p99": round(percentile(ordered, 99), 4),
        "mean": round(statistics.fmean(ordered), 4),
        "n": len(ordered),
    }
