"""`loraplex bench long-prompts`: short prompts' first token while 8k-token prompts arrive.

One `loraplex serve` per setting, in turn: "capped" (the long-prefill cap as served by
default: a prompt with more than `--long-prefill-token-threshold` tokens left gets at most
that many tokens of a step until the other requests were served) and "uncapped"
(`--long-prefill-token-threshold 0`: a running prefill takes all the budget it can, as
before the cap), and "unchunked" (`--max-num-batched-tokens 8192` as well: one step takes a
whole prompt, no chunked prefill). All get the same open-loop arrivals: long prompts at
fixed intervals, short ones Poisson in between, every one streamed, greedy, `ignore_eos`.

Figures per setting: short prompts' TTFT p50 / p99 (seconds, and engine steps: TTFT over
the run's mean step time) and TPOT p50 / p99 (their decodes run beside the long prefills),
long prompts' TTFT p50, the time until the last request ended,
and throughput as tokens computed (prompt + output) per second of engine step time, read
from the server's /metrics (loraplex_engine_step_seconds_total), so that the open-loop idle
time does not count.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import loops
from bench.harness.options import opt
from bench.harness.report import print_row, report_header, write_report
from bench.harness.server import engine_counters, model_name, running_server
from bench.harness.workload import (
    BenchRequest,
    RequestTiming,
    _one_stream,
    make_requests,
    percentile,
)
from bench.lora import resolve_model

SETTINGS: dict[str, list[str]] = {
    # No chunked prefill either: a step takes a whole 8k prompt (the flags given last win).
    "unchunked": ["--max-num-batched-tokens", "8192", "--long-prefill-token-threshold", "0"],
    "uncapped": ["--long-prefill-token-threshold", "0"],
    "capped": [],  # the defaults
}


@dataclass(slots=True)
class LongPromptOptions:
    model: str = "default"
    long_requests: int = 3
    long_prompt_len: int = 8000
    long_output_len: int = 8
    long_interval_s: float = opt(20.0, "seconds between long prompts")
    short_rate: float = opt(0.5, "short prompts per second (Poisson)")
    short_prompt_len: tuple[int, int] = opt((32, 96), "min-max tokens")
    short_output_len: int = 16
    seed: int = 0
    settings: tuple[str, ...] = opt(
        ("unchunked", "uncapped", "capped"), "one server per setting", flag="--setting",
        choices=("unchunked", "uncapped", "capped"))
    # NOTE: steps of 512 tokens: on two CPU cores a step at an 8k context takes ~1-2 s, so
    # a short prompt's floor (the step in progress, then its own) stays near a few seconds.
    serve_args: list[str] = opt(
        ["--max-num-batched-tokens", "512", "--kv-cache-tokens", "40960"],
        "extra flag for `serve`", flag="--serve-arg")
    output: Path | None = opt(None, "JSON report")


@dataclass(slots=True)
class Arrival:
    at_s: float
    kind: str  # "long" | "short"
    request: BenchRequest


def arrivals(opts: LongPromptOptions, vocab_size: int) -> list[Arrival]:
    """Long prompts at 0, interval, 2 x interval...; short ones Poisson over that span and
    one interval more."""
    longs = make_requests(
        opts.long_requests, vocab_size=vocab_size,
        prompt_len=(opts.long_prompt_len, opts.long_prompt_len),
        output_len=(opts.long_output_len, opts.long_output_len), seed=opts.seed,
    )
    out = [Arrival(i * opts.long_interval_s, "long", r) for i, r in enumerate(longs)]
    span = opts.long_requests * opts.long_interval_s
    rng = random.Random(opts.seed + 1)
    at = rng.expovariate(opts.short_rate)
    times: list[float] = []
    while at < span:
        times.append(at)
        at += rng.expovariate(opts.short_rate)
    shorts = make_requests(
        len(times), vocab_size=vocab_size, prompt_len=opts.short_prompt_len,
        output_len=(opts.short_output_len, opts.short_output_len), seed=opts.seed + 2,
    )
    out += [Arrival(t, "short", r) for t, r in zip(times, shorts, strict=True)]
    return sorted(out, key=lambda a: a.at_s)


async def _replay(
    base_url: str, model: str, schedule: list[Arrival]
) -> tuple[list[tuple[str, RequestTiming]], float]:
    limits = httpx.Limits(max_connections=len(schedule) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        warm = BenchRequest(prompt_token_ids=schedule[0].request.prompt_token_ids[:16],
                            max_tokens=2)
        await _one_stream(client, model, warm)
        timings: dict[int, RequestTiming] = {}

        async def send(index: int, due: float) -> None:
            timings[index] = await _one_stream(client, model, schedule[index].request)

        wall = await loops.open_loop([a.at_s for a in schedule], send)
    return [(a.kind, timings[i]) for i, a in enumerate(schedule)], wall


def summarize(
    setting: str,
    timings: list[tuple[str, RequestTiming]],
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, object]:
    delta = {k: after[k] - before[k] for k in after}
    steps = delta["loraplex_engine_steps_total"]
    step_s = delta["loraplex_engine_step_seconds_total"]
    mean_step = step_s / steps if steps else float("nan")
    short = sorted(t.ttft_s for kind, t in timings if kind == "short")
    long = sorted(t.ttft_s for kind, t in timings if kind == "long")
    tpot = sorted(x for kind, t in timings if kind == "short" and (x := t.tpot_s) is not None)
    computed = (
        delta["loraplex_prompt_tokens_total"] - delta["loraplex_prefix_cache_hits_total"]
        + delta["loraplex_generation_tokens_total"]
    )
    return {
        "setting": setting,
        "short_requests": len(short),
        "short_ttft_p50_s": round(percentile(short, 50), 3),
        "short_ttft_p99_s": round(percentile(short, 99), 3),
        "short_ttft_p50_steps": round(percentile(short, 50) / mean_step, 2),
        "short_ttft_p99_steps": round(percentile(short, 99) / mean_step, 2),
        "short_tpot_p50_s": round(percentile(tpot, 50), 4),
        "short_tpot_p99_s": round(percentile(tpot, 99), 4),
        "long_ttft_p50_s": round(percentile(long, 50), 3),
        "mean_step_s": round(mean_step, 4),
        "steps": int(steps),
        "makespan_s": round(wall_s, 2),
        "tokens_per_step_second": round(computed / step_s, 1) if step_s else float("nan"),
    }


def run_long_prompts(opts: LongPromptOptions) -> dict[str, object]:
    unknown = set(opts.settings) - SETTINGS.keys()
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    model_dir, config = resolve_model(opts.model)
    schedule = arrivals(opts, config.vocab_size)
    report: dict[str, object] = report_header("long-prompts", opts)
    results: list[dict[str, object]] = []
    for setting in opts.settings:
        serve_args = ["--model", str(model_dir), *opts.serve_args, *SETTINGS[setting]]
        # Each server its own data directory (usage spool, database); the model converted
        # once is passed by its directory.
        with tempfile.TemporaryDirectory(prefix="loraplex-long-prompts-") as data_dir, \
                running_server(serve_args, env={"LORAPLEX_DATA_DIR": data_dir}) as base_url:
            model = model_name(base_url)
            before = engine_counters(base_url)
            timings, wall = asyncio.run(_replay(base_url, model, schedule))
            results.append(summarize(setting, timings, wall, before, engine_counters(base_url)))
        print_row(setting, results[-1])
    report["results"] = results
    by_setting = {r["setting"]: r for r in results}
    if {"capped", "uncapped"} <= by_setting.keys():
        capped, uncapped = by_setting["capped"], by_setting["uncapped"]
        report["ratios"] = {
            "short_ttft_p99_uncapped_over_capped": _ratio(
                uncapped["short_ttft_p99_s"], capped["short_ttft_p99_s"]),
            "throughput_capped_over_uncapped": _ratio(
                capped["tokens_per_step_second"], uncapped["tokens_per_step_second"]),
        }
    if {"unchunked", "uncapped"} <= by_setting.keys():
        report.setdefault("ratios", {})
        assert isinstance(report["ratios"], dict)
        report["ratios"]["short_tpot_p99_unchunked_over_chunked"] = _ratio(
            by_setting["unchunked"]["short_tpot_p99_s"], by_setting["uncapped"]["short_tpot_p99_s"])
        print("ratios:", json.dumps(report["ratios"]), flush=True)
    write_report(report, opts.output)
    return report


def _ratio(numerator: object, denominator: object) -> float:
    assert isinstance(numerator, float) and isinstance(denominator, float)
    return round(numerator / denominator, 2) if denominator else float("nan")
