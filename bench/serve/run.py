"""`loraplex bench serve`: open-loop load against an OpenAI-compatible server, swept
over request rates.

Requests arrive at each `--rate` as a Poisson process (or gamma, `--burstiness`), each a
greedy stream of `POST /v1/completions` with `ignore_eos`, on the base model or on one of
`--num-adapters` LoRA adapters (uniform or Zipf popularity), a fraction of them behind a
shared per-tenant system prompt. Per request: TTFT, TPOT, inter-token latencies, e2e
latency, output tokens, error; per rate: achieved rate, output tokens/s, percentiles,
goodput within the TTFT/TPOT objectives. Against loraplex it also samples `/metrics` (KV
usage, queue, prefix-cache hits) and, for a server it started, the server's RSS.

Without `--base-url` it starts `loraplex serve` on the bundled model (or `--model`) with
random rank-16 PEFT adapters; with one it starts nothing and loads that server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, fields
from typing import Any

import httpx

from bench.harness.report import ReportHead, machine_description, save_report
from bench.serve.client import RequestRecord, Target, run_schedule, send_stream
from bench.serve.monitor import ServerMonitor
from bench.serve.options import ServeOptions
from bench.serve.report import plot_sweep, rate_table, sweep_table
from bench.serve.stats import RateSummary, summarize
from bench.serve.target import open_target
from bench.serve.workload import (
    MixOptions,
    ServeRequest,
    arrival_times,
    build_requests,
    load_dataset,
)


@dataclass(slots=True)
class RateRun:
    summary: RateSummary
    records: list[RequestRecord]


@dataclass(slots=True)
class ServeReport(ReportHead):  # options: ServeOptions
    base_url: str
    model: str
    started_server: bool
    runs: list[RateRun]

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "serve",
            "machine": self.machine,
            "started_at": self.started_at,
            "options": self.options.to_json(),
            "target": {"base_url": self.base_url, "model": self.model,
                       "started_server": self.started_server},
            "rates": [run.summary.to_json() for run in self.runs],
            "requests": {run.summary.rate_label: [r.to_json() for r in run.records]
                         for run in self.runs},
        }


def run_serve(opts: ServeOptions) -> ServeReport:
    opts.validate()
    mix = MixOptions(
        **{f.name: getattr(opts, f.name) for f in fields(MixOptions)
           if f.name not in ("dataset", "adapters")},
        dataset=None if opts.dataset is None else load_dataset(opts.dataset),
        adapters=opts.adapter_names,
    )
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open_target(opts) as target:
        runs = asyncio.run(_sweep(opts, target, mix))
    report = ServeReport(
        options=opts, machine=machine_description(), started_at=started_at,
        base_url=target.base_url, model=target.model,
        started_server=target.pid is not None, runs=runs,
    )
    print(sweep_table([run.summary for run in runs]), flush=True)
    save_report(report.to_json(), "serve", opts.output)
    if opts.plot is not None:
        plot_sweep([run.summary for run in runs], opts.slo, opts.plot)
        print(f"plot: {opts.plot}", flush=True)
    return report


async def _sweep(opts: ServeOptions, target: Target, mix: MixOptions) -> list[RateRun]:
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    # Open loop: the pool must never hold a request back.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    runs: list[RateRun] = []
    async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers,
                                 timeout=timeout, limits=limits) as client:
        await _warm_up(client, target, opts.adapter_names)
        for index, rate in enumerate(opts.rates):
            arrivals = arrival_times(rate, num_requests=opts.requests_per_rate,
                                     duration_s=opts.duration_s, burstiness=opts.burstiness,
                                     seed=opts.seed)
            requests = build_requests(len(arrivals), mix, vocab_size=target.vocab_size,
                                      seed=opts.seed, content_seed=opts.seed * 1000 + index + 1)
            async with ServerMonitor(client, pid=target.pid,
                                     interval_s=opts.metrics_interval_s) as monitor:
                records, duration_s = await run_schedule(client, target, requests, arrivals,
                                                         max_concurrency=opts.max_concurrency)
            server = monitor.summary() if monitor.has_data else None
            summary = summarize(rate, records, duration_s, opts.slo, server)
            print(rate_table(summary, opts.slo), flush=True)
            runs.append(RateRun(summary, records))
    return runs


async def _warm_up(client: httpx.AsyncClient, target: Target, adapters: list[str]) -> None:
    """One short request per model first: the base model's first steps and the adapters'
    loads are not measured, and an adapter the server lacks fails here, clearly."""
    vocab_size = target.vocab_size
    prompt: str | list[int] = "Hello" if vocab_size is None else [min(1000, vocab_size // 4)] * 8
    records = await asyncio.gather(*(
        send_stream(client, target, ServeRequest(prompt, 2, adapter, None),
                    RequestRecord(-1, target.served_name(adapter), scheduled_s=0.0))
        for adapter in (None, *adapters)
    ))
    failed = [f"{r.model}: {r.error}" for r in records if not r.ok]
    if failed:
        raise RuntimeError("warm-up requests failed:\n" + "\n".join(failed))
