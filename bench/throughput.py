"""`loraplex bench throughput`: the engine behind the HTTP server against HF `generate`.

Same requests, same machine, same run: engine output tokens/s over N concurrent
streams, TTFT p50/p99, TPOT p50, and the server's resident memory (RSS once ready, at
its peak, at the end of the load); then Hugging Face `generate` one request at a time
and in static batches; the ratios are what `docs/BENCHMARKS.md` records.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.harness.server import ProcessMemory, model_name, running_server
from bench.harness.workload import BenchRequest, LoadResult, make_requests, run_load
from bench.hf_baseline import HFResult, load_hf_model, run_one_at_a_time, run_static_batches
from bench.lora import resolve_model


@dataclass(slots=True)
class ThroughputOptions:
    model: str = "default"
    num_requests: int = 32
    concurrency: int = 32
    prompt_len: tuple[int, int] = opt((20, 400), "min-max tokens")
    output_len: tuple[int, int] = opt((16, 128), "min-max tokens")
    seed: int = 0
    hf_batch_size: int = 8
    hf_single_requests: int = 4  # one-at-a-time is slow: a prefix of the requests
    skip_hf: bool = opt(False, "engine only, no baseline")
    # Each side runs this many times, alternating; the best run of each is compared.
    # NOTE: best-of estimates the uncontended speed on a shared, noisy machine; every
    # run is kept in the JSON report.
    repeats: int = opt(1, "alternating runs; best compared")
    serve_args: list[str] = opt([], "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = None


def run_throughput(opts: ThroughputOptions) -> dict[str, object]:
    model_dir, config = resolve_model(opts.model)
    requests = make_requests(
        opts.num_requests, vocab_size=config.vocab_size, prompt_len=opts.prompt_len,
        output_len=opts.output_len, seed=opts.seed,
    )
    report = report_header("throughput", opts)
    engine_runs: list[tuple[LoadResult, dict[str, object]]] = []  # each with its report row
    static_runs: list[HFResult] = []
    single: HFResult | None = None
    hf_model = None if opts.skip_hf else load_hf_model(model_dir)
    for round_index in range(opts.repeats):
        procs: list[subprocess.Popen[bytes]] = []
        with running_server(["--model", opts.model, *opts.serve_args], on_start=procs.append
                            ) as base_url:
            server = ProcessMemory(procs[0].pid)
            ready_rss = server.rss_mb()
            base_model = model_name(base_url)
            warm = [BenchRequest(prompt_token_ids=requests[0].prompt_token_ids[:32], max_tokens=4)]
            asyncio.run(run_load(base_url, base_model, warm, 1))
            result = asyncio.run(run_load(base_url, base_model, requests, opts.concurrency))
            row: dict[str, object] = {
                **result.summary(),
                "ready_rss_mb": ready_rss,
                "peak_rss_mb": server.peak_rss_mb(),  # VmHWM: the kernel's high-water mark
                "end_rss_mb": server.rss_mb(),
            }
        engine_runs.append((result, row))
        print_row(f"engine #{round_index}", row)
        if hf_model is None:
            continue
        if single is None:
            run_one_at_a_time(hf_model, [BenchRequest(requests[0].prompt_token_ids[:16], 2)])
            single = run_one_at_a_time(hf_model, requests[: opts.hf_single_requests])
            print_row("hf one-at-a-time", single.summary())
        static_runs.append(run_static_batches(hf_model, requests, opts.hf_batch_size))
        print_row(f"hf static x{opts.hf_batch_size} #{round_index}", static_runs[-1].summary())

    engine, best_row = max(engine_runs, key=lambda run: run[0].output_tokens_per_s)
    report["engine"] = best_row
    report["engine_runs"] = [row for _, row in engine_runs]
    if single is not None and static_runs:
        static = max(static_runs, key=lambda r: r.output_tokens_per_s)
        report["hf_one_at_a_time"] = single.summary()
        report["hf_static_batches"] = static.summary()
        report["hf_static_runs"] = [r.summary() for r in static_runs]
        rate = engine.output_tokens_per_s
        report["ratios"] = {
            "engine_vs_hf_static": round(rate / static.output_tokens_per_s, 2),
            "engine_vs_hf_one_at_a_time": round(rate / single.output_tokens_per_s, 2),
        }
        print("best of each:", json.dumps(report["ratios"]))
    write_report(report, opts.output)
    return report
