"""`loraplex bench fairness`: a noisy neighbour through the HTTP API, with and without fairness.

One `loraplex serve` per scheduling mode (`--fairness vtc`, then `fcfs`), with API keys:
tenants and their keys are created through the admin API, so the server knows each request's
tenant from its key, as in production. In each scenario a "flood" tenant sends many long
prompts at once and a "probe" tenant sends a few short requests meanwhile, spaced in time;
the figure is the probe's median TTFT against the flood's. Scenarios:

- tenants: two standard-tier tenants; with VTC the probe is served as soon as its tenant's
  counter is the smallest, with fcfs it queues behind the flood;
- tiers: a batch-tier tenant floods, a premium-tier tenant probes; priorities hold in both
  modes (fcfs keeps priorities, it only drops the counters).

Every request streams (`POST /v1/completions`, greedy, `ignore_eos`), so each does the same
work on every run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import loops
from bench.harness.options import opt
from bench.harness.report import machine_description, options_json, print_row, save_report
from bench.harness.server import engine_counters, model_name, serve_with_keys
from bench.harness.tenants import TenantKey, create_tenant
from bench.harness.workload import (
    BenchRequest,
    RequestTiming,
    _one_stream,
    make_requests,
    median,
    percentile,
)
from engine.config import default_data_dir
from engine.models.loader import load_model_config, resolve_model_dir

# scenario -> (flood tenant's tier, probe tenant's tier)
SCENARIOS: dict[str, tuple[str, str]] = {
    "tenants": ("standard", "standard"),
    "tiers": ("batch", "premium"),
}
MODES = ("vtc", "fcfs")


@dataclass(slots=True)
class FairnessOptions:
    model: str = "default"
    scenarios: tuple[str, ...] = opt(
        ("tenants", "tiers"), "tenants: two standard tenants; tiers: batch floods, premium probes",
        flag="--scenario", choices=("tenants", "tiers"))
    modes: tuple[str, ...] = opt(MODES, "one server per mode", flag="--fairness", choices=MODES)
    flood_requests: int = 24
    flood_prompt_len: tuple[int, int] = opt((400, 800), "min-max tokens")
    flood_output_len: tuple[int, int] = opt((32, 32), "min-max tokens")
    probe_requests: int = 6
    probe_prompt_len: tuple[int, int] = opt((20, 60), "min-max tokens")
    probe_output_len: tuple[int, int] = opt((16, 16), "min-max tokens")
    probe_start_s: float = opt(2.0, "seconds after the flood")
    probe_interval_s: float = opt(2.0, "seconds between probes")
    shared_prefix_len: int = opt(
        0, "tokens every flood prompt starts with (a system prompt: prefix-cache hits)")
    seed: int = 0
    # NOTE: a probe waits at least for the step in progress and then its own: on two CPU
    # cores a 2,048-token step takes ~3 s, so steps of 512 tokens keep that floor near 1 s.
    serve_args: list[str] = opt(
        ["--max-num-batched-tokens", "512"], "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = None


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    mode: str
    flood_ttft_s: list[float]
    probe_ttft_s: list[float]
    wall_s: float
    mean_step_s: float  # the engine's, over the scenario

    def summary(self) -> dict[str, object]:
        flood, probe = sorted(self.flood_ttft_s), sorted(self.probe_ttft_s)
        flood_p50, probe_p50 = median(flood), median(probe)
        return {
            "scenario": self.scenario,
            "fairness": self.mode,
            "flood_ttft_p50_s": round(flood_p50, 3),
            "flood_ttft_p90_s": round(percentile(flood, 90), 3),
            "probe_ttft_p50_s": round(probe_p50, 3),
            "probe_ttft_max_s": round(probe[-1], 3),
            "probe_over_flood_p50": round(probe_p50 / flood_p50, 3),
            "mean_step_s": round(self.mean_step_s, 4),
            "probe_ttft_p50_steps": round(probe_p50 / self.mean_step_s, 2),
            "flood_ttft_p50_steps": round(flood_p50 / self.mean_step_s, 2),
            "wall_s": round(self.wall_s, 2),
        }


def run_fairness(opts: FairnessOptions) -> dict[str, object]:
    unknown = set(opts.scenarios) - SCENARIOS.keys() | set(opts.modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown scenarios or modes: {sorted(unknown)}")
    vocab = load_model_config(resolve_model_dir(opts.model, default_data_dir())).vocab_size
    flood = make_requests(opts.flood_requests, vocab_size=vocab, prompt_len=opts.flood_prompt_len,
                          output_len=opts.flood_output_len, seed=opts.seed)
    if opts.shared_prefix_len:
        [prefix] = make_requests(
            1, vocab_size=vocab, prompt_len=(opts.shared_prefix_len, opts.shared_prefix_len),
            output_len=(1, 1), seed=opts.seed + 2)
        for request in flood:
            request.prompt_token_ids = prefix.prompt_token_ids + request.prompt_token_ids
    probe = make_requests(opts.probe_requests, vocab_size=vocab, prompt_len=opts.probe_prompt_len,
                          output_len=opts.probe_output_len, seed=opts.seed + 1)
    report: dict[str, object] = {
        "benchmark": "fairness",
        "machine": machine_description(),
        "options": options_json(opts),
        "workload": {
            "flood_prompt_tokens": sum(len(r.prompt_token_ids) for r in flood),
            "probe_prompt_tokens": sum(len(r.prompt_token_ids) for r in probe),
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    results: list[dict[str, object]] = []
    for mode in opts.modes:
        serve_args = ["--model", opts.model, "--fairness", mode, *opts.serve_args]
        # A fresh SQLite database in a temporary data directory, per-process quotas.
        with tempfile.TemporaryDirectory(prefix="loraplex-fairness-") as data_dir, \
                serve_with_keys(serve_args, Path(data_dir)) as (server, admin_key):
            for scenario in opts.scenarios:
                flood_key, probe_key = (
                    create_tenant(server.base_url, admin_key, f"{scenario}-{role}", tier=tier)
                    for role, tier in zip(("flood", "probe"), SCENARIOS[scenario], strict=True))
                result = asyncio.run(run_scenario(server.base_url, scenario, mode, flood_key,
                                                  probe_key, flood, probe, opts))
                results.append(result.summary())
                print_row(f"{scenario} {mode}", results[-1])
    report["results"] = results
    save_report(report, "fairness", opts.output)
    return report


async def run_scenario(
    base_url: str, scenario: str, mode: str, flood_key: TenantKey, probe_key: TenantKey,
    flood: list[BenchRequest], probe: list[BenchRequest], opts: FairnessOptions,
) -> ScenarioResult:
    """The flood all at once, then the probes at their times; every request streams."""
    limits = httpx.Limits(max_connections=len(flood) + len(probe) + 4)

    def client(key: TenantKey) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits,
                                 headers=key.headers)

    async with client(flood_key) as flood_client, client(probe_key) as probe_client:
        model = model_name(base_url, flood_key.headers)
        warm = BenchRequest(prompt_token_ids=flood[0].prompt_token_ids[:16], max_tokens=2)
        await _one_stream(flood_client, model, warm)
        before = engine_counters(base_url)
        start = time.perf_counter()
        flooding = asyncio.gather(*(_one_stream(flood_client, model, r) for r in flood))
        probe_timings: dict[int, RequestTiming] = {}

        async def send_probe(index: int, due: float) -> None:
            probe_timings[index] = await _one_stream(probe_client, model, probe[index])

        await loops.open_loop([opts.probe_start_s + i * opts.probe_interval_s
                               for i in range(len(probe))], send_probe)
        flood_timings = await flooding
        wall = time.perf_counter() - start
        after = engine_counters(base_url)
    steps = after["loraplex_engine_steps_total"] - before["loraplex_engine_steps_total"]
    step_s = (after["loraplex_engine_step_seconds_total"]
              - before["loraplex_engine_step_seconds_total"])
    return ScenarioResult(
        scenario=scenario,
        mode=mode,
        flood_ttft_s=[t.ttft_s for t in flood_timings],
        probe_ttft_s=[probe_timings[i].ttft_s for i in range(len(probe))],
        wall_s=wall,
        mean_step_s=step_s / steps if steps else float("nan"),
    )

