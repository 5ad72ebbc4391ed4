"""`loraplex bench ...`: the benchmarks, as click commands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from bench.lora import LoRABenchOptions


@click.group("bench")
def bench() -> None:
    """Run the benchmarks in bench/ (figures go to docs/BENCHMARKS.md)."""


def _range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    return int(low), int(high or low)


@bench.command("throughput")
@click.option("--model", default="default", show_default=True)
@click.option("--num-requests", default=32, show_default=True)
@click.option("--concurrency", default=32, show_default=True)
@click.option("--prompt-len", default="20-400", show_default=True, help="min-max tokens")
@click.option("--output-len", default="16-128", show_default=True, help="min-max tokens")
@click.option("--seed", default=0, show_default=True)
@click.option("--hf-batch-size", default=8, show_default=True)
@click.option("--hf-single-requests", default=4, show_default=True)
@click.option("--skip-hf", is_flag=True, help="engine only, no baseline")
@click.option("--repeats", default=1, show_default=True, help="alternating runs; best compared")
@click.option("--serve-arg", "serve_args", multiple=True, help="extra flag for `serve`")
@click.option("--output", type=click.Path(path_type=Path), default=None)
def throughput(
    model: str,
    num_requests: int,
    concurrency: int,
    prompt_len: str,
    output_len: str,
    seed: int,
    hf_batch_size: int,
    hf_single_requests: int,
    skip_hf: bool,
    repeats: int,
    serve_args: tuple[str, ...],
    output: Path | None,
) -> None:
    """N concurrent streams through the server vs HF generate on the same requests."""
    from bench.throughput import ThroughputOptions, run_throughput

    run_throughput(
        ThroughputOptions(
            model=model,
            num_requests=num_requests,
            concurrency=concurrency,
            prompt_len=_range(prompt_len),
            output_len=_range(output_len),
            seed=seed,
            hf_batch_size=hf_batch_size,
            hf_single_requests=hf_single_requests,
            skip_hf=skip_hf,
            repeats=repeats,
            serve_args=[a for arg in serve_args for a in arg.split()],
            output=output,
        )
    )


@bench.command("roofline")
@click.option("--model", default="default", show_default=True)
@click.option("--num-seqs", default=32, show_default=True)
@click.option("--context-len", default="200-500", show_default=True, help="min-max tokens")
@click.option("--num-adapters", default=8, show_default=True, help="0: base model only")
@click.option("--rank", default=16, show_default=True)
@click.option("--targets", type=click.Choice(["qv", "attention", "all-linear"]),
              default="attention", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help="the engine's dtype (auto: what serving picks here)")
@click.option("--steps", default=16, show_default=True, help="timed decode steps per round")
@click.option("--repeats", default=2, show_default=True, help="alternating base/LoRA rounds")
@click.option("--compare-gather", is_flag=True, help="also alternate kernel / gather steps")
@click.option("--compare-cpu-ops", is_flag=True,
              help="also alternate fused CPU kernels / torch ops steps")
@click.option("--output", type=click.Path(path_type=Path), default=None)
def roofline(context_len: str, **kwargs: Any) -> None:
    """Matmul peak and memory bandwidth, and a decode step's parts against them."""
    from bench.roofline import RooflineOptions, run_roofline

    run_roofline(RooflineOptions(context_len=_range(context_len), **kwargs))


@bench.command("kernels")
@click.option(
    "--tokens", "num_tokens", multiple=True, type=int, default=(16, 64, 256), show_default=True
)
@click.option(
    "--popularity",
    multiple=True,
    type=click.Choice(["identical", "distinct", "skewed"]),
    default=("identical", "distinct"),
    show_default=True,
)
@click.option("--rank", default=16, show_default=True, help="every adapter's rank")
@click.option("--max-rank", default=64, show_default=True, help="the slot buffers' R")
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
)
@click.option("--warmup", default=10, show_default=True)
@click.option("--iters", default=50, show_default=True, help="timed runs; the median is kept")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/kernels-<timestamp>.json]",
)
def kernels(
    num_tokens: tuple[int, ...],
    popularity: tuple[str, ...],
    rank: int,
    max_rank: int,
    dtype: str,
    warmup: int,
    iters: int,
    seed: int,
    output: Path | None,
) -> None:
    """Triton lora_shrink / lora_expand vs the torch reference and gather-bmm (CUDA only)."""
    from bench.kernels import KernelsOptions, run_kernels

    run_kernels(
        KernelsOptions(
            num_tokens=num_tokens,
            popularity=popularity,
            rank=rank,
            max_rank=max_rank,
            dtype=dtype,
            warmup=warmup,
            iters=iters,
            seed=seed,
            output=output,
        )
    )


@bench.command("gateway")
@click.option("--rate", default=200.0, show_default=True, help="open-loop requests/s")
@click.option("--duration", "duration_s", default=10.0, show_default=True,
              help="seconds per measured run")
@click.option("--warmup", "warmup_s", default=1.0, show_default=True,
              help="seconds of the same load before each run")
@click.option("--concurrency", default=32, show_default=True, help="closed-loop workers")
@click.option("--repeats", default=3, show_default=True, help="alternating rounds")
@click.option("--max-tokens", default=16, show_default=True)
@click.option("--client", type=click.Choice(["raw", "httpx"]), default="raw", show_default=True,
              help="the load generator's HTTP client (raw: minimal keep-alive HTTP/1.1)")
@click.option("--database-url", default=None,
              help="a fresh database both servers share (migrated first) [default: SQLite "
                   "files in a temporary directory]")
@click.option("--redis-url", default="redis://127.0.0.1:6379/13", show_default=True,
              help="the quota store; this Redis database is FLUSHED before the run")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/gateway-<timestamp>.json]",
)
def gateway(**kwargs: Any) -> None:
    """Gateway overhead: chat requests (keys, Redis quotas, metering) against an engine
    that answers instantly, vs GET /health, open loop at --rate; then a closed loop."""
    from bench.gateway.run import GatewayOptions, run_gateway

    run_gateway(GatewayOptions(**kwargs))


def _lora_options(func: Callable[..., None]) -> Callable[..., None]:
    """The options every LoRA benchmark shares."""
    options = [
        click.option("--model", default="default", show_default=True),
        click.option("--num-adapters", default=32, show_default=True),
        click.option("--num-requests", default=32, show_default=True),
        click.option("--rank", default=16, show_default=True),
        click.option(
            "--targets",
            type=click.Choice(["qv", "attention", "all-linear"]),
            default="attention",
            show_default=True,
        ),
        click.option("--prompt-len", default="32-256", show_default=True, help="min-max tokens"),
        click.option("--output-len", default="64-128", show_default=True, help="min-max tokens"),
        click.option("--seed", default=0, show_default=True),
        click.option("--repeats", default=2, show_default=True, help="alternating rounds"),
        click.option(
            "--stream/--no-stream",
            default=False,
            show_default=True,
            help="send requests as SSE streams (TTFT/TPOT figures, more client work)",
        ),
        click.option("--serve-arg", "serve_args", multiple=True, help="extra flag for `serve`"),
        click.option("--output", type=click.Path(path_type=Path), default=None),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _lora_bench_options(**kwargs: Any) -> LoRABenchOptions:
    from bench.lora import LoRABenchOptions

    serve_args: tuple[str, ...] = kwargs.pop("serve_args", ())
    kwargs["prompt_len"] = _range(kwargs["prompt_len"])
    kwargs["output_len"] = _range(kwargs["output_len"])
    return LoRABenchOptions(
        serve_args=[a for arg in serve_args for a in arg.split()],
        **kwargs,
    )


@bench.command("lora-scaling")
@_lora_options
@click.option("--zipf-alpha", default=1.0, show_default=True)
def lora_scaling(**kwargs: Any) -> None:
    """N concurrent requests on 1 adapter vs N distinct adapters (uniform, Zipf)."""
    from bench.lora import run_scaling

    run_scaling(_lora_bench_options(**kwargs))


@bench.command("lora-vs-peft")
@_lora_options
@click.option("--hf-batch-size", default=8, show_default=True)
def lora_vs_peft(**kwargs: Any) -> None:
    """The server vs Hugging Face PEFT (one at a time, static mixed batches)."""
    from bench.lora import run_vs_peft

    run_vs_peft(_lora_bench_options(**kwargs))


@bench.command("lora-overhead")
@_lora_options
def lora_overhead(**kwargs: Any) -> None:
    """Step time with every request on one adapter vs on the base model."""
    from bench.lora import run_overhead

    run_overhead(_lora_bench_options(**kwargs))


@bench.command("lora-cold-load")
@_lora_options
@click.option("--loads", default=20, show_default=True)
def lora_cold_load(loads: int, **kwargs: Any) -> None:
    """An adapter from disk to ready (p50/p99) vs PEFT's load_adapter."""
    from bench.lora import run_cold_load

    run_cold_load(_lora_bench_options(**kwargs), loads=loads)


@bench.command("serve")
@click.option("--base-url", default=None,
              help="an OpenAI-compatible server to load [default: start `loraplex serve`]")
@click.option("--model", default=None,
              help="base model [default: `default` when started here, else the server's first]")
@click.option("--adapter-model", "adapter_models", multiple=True, metavar="NAME=SERVED_NAME",
              help="what the server at --base-url calls adapter NAME (lora-0, lora-1, ...)")
@click.option("--api-key", default=None, help="sent as a Bearer token")
@click.option("--vocab-size", type=int, default=None,
              help="for random token prompts [default: from the local model's config]")
@click.option("--rate", "rates", multiple=True, default=("1",), show_default=True,
              help="requests/s, repeatable or a comma list; inf: all at once")
@click.option("--burstiness", default=1.0, show_default=True,
              help="gamma shape of the gaps: 1 Poisson, < 1 burstier")
@click.option("--num-requests", type=int, default=None,
              help="per rate [default: 64 unless --duration]")
@click.option("--duration", "duration_s", type=float, default=None,
              help="seconds of arrivals per rate")
@click.option("--max-concurrency", type=int, default=None, help="cap on streams in flight")
@click.option("--prompt-len", default="64-512", show_default=True, help="N or min-max tokens")
@click.option("--output-len", default="32-128", show_default=True, help="N or min-max tokens")
@click.option("--dataset", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              default=None, help='JSONL: {"prompt" or "prompt_len", "output_len"} per line')
@click.option("--num-adapters", default=0, show_default=True,
              help="rank-16 adapters lora-0..; 0: base model only")
@click.option("--adapter-dist", type=click.Choice(["uniform", "zipf"]), default="uniform",
              show_default=True)
@click.option("--zipf-alpha", default=1.0, show_default=True)
@click.option("--shared-prefix-fraction", default=0.0, show_default=True,
              help="requests that start with their adapter's system prompt")
@click.option("--shared-prefix-len", default=256, show_default=True, help="tokens")
@click.option("--slo-ttft", "slo_ttft_s", default=2.0, show_default=True, help="seconds")
@click.option("--slo-tpot", "slo_tpot_s", default=0.2, show_default=True, help="seconds")
@click.option("--seed", default=0, show_default=True)
@click.option("--request-timeout", "request_timeout_s", default=600.0, show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True)
@click.option("--serve-arg", "serve_args", multiple=True, help="extra flag for `serve`")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="JSON report [default: bench/results/serve-<timestamp>.json]")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="PNG of the sweep")
def serve(**kwargs: Any) -> None:
    """Open-loop streams at each --rate (Poisson or gamma arrivals): TTFT, TPOT, ITL, e2e
    percentiles, throughput and goodput within the SLOs; KV, queue and RSS of loraplex."""
    from bench.serve.options import options_from_cli
    from bench.serve.run import run_serve

    try:
        options = options_from_cli(**kwargs)
        options.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    run_serve(options)


@bench.command("fairness")
@click.option("--model", default="default", show_default=True)
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice(["tenants", "tiers"]),
              default=("tenants", "tiers"), show_default=True,
              help="tenants: two standard tenants; tiers: batch floods, premium probes")
@click.option("--fairness", "modes", multiple=True, type=click.Choice(["vtc", "fcfs"]),
              default=("vtc", "fcfs"), show_default=True, help="one server per mode")
@click.option("--flood-requests", default=24, show_default=True)
@click.option("--flood-prompt-len", default="400-800", show_default=True, help="min-max tokens")
@click.option("--flood-output-len", default="32", show_default=True, help="min-max tokens")
@click.option("--probe-requests", default=6, show_default=True)
@click.option("--probe-prompt-len", default="20-60", show_default=True, help="min-max tokens")
@click.option("--probe-output-len", default="16", show_default=True, help="min-max tokens")
@click.option("--probe-start", "probe_start_s", default=2.0, show_default=True,
              help="seconds after the flood")
@click.option("--probe-interval", "probe_interval_s", default=2.0, show_default=True,
              help="seconds between probes")
@click.option("--shared-prefix-len", default=0, show_default=True,
              help="tokens every flood prompt starts with (a system prompt: prefix-cache hits)")
@click.option("--seed", default=0, show_default=True)
@click.option("--serve-arg", "serve_args", multiple=True,
              help="extra flag for `serve` [default: --max-num-batched-tokens 512]")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/fairness-<timestamp>.json]",
)
def fairness(
    scenarios: tuple[str, ...],
    modes: tuple[str, ...],
    flood_prompt_len: str,
    flood_output_len: str,
    probe_prompt_len: str,
    probe_output_len: str,
    serve_args: tuple[str, ...],
    **kwargs: Any,
) -> None:
    """Noisy neighbour through the HTTP API: one tenant floods, another probes; TTFT of
    each, with VTC fairness and with fcfs."""
    from bench.fairness import FairnessOptions, run_fairness

    options = FairnessOptions(
        scenarios=scenarios,
        modes=modes,
        flood_prompt_len=_range(flood_prompt_len),
        flood_output_len=_range(flood_output_len),
        probe_prompt_len=_range(probe_prompt_len),
        probe_output_len=_range(probe_output_len),
        **kwargs,
    )
    if serve_args:
        options.serve_args = [a for arg in serve_args for a in arg.split()]
    run_fairness(options)


@bench.command("soak")
@click.option("--model", default="default", show_default=True)
@click.option("--minutes", default=2.0, show_default=True, help="length of the open-loop load")
@click.option("--seconds", default=None, type=float, help="length in seconds (overrides --minutes)")
@click.option("--load-fraction", default=0.7, show_default=True,
              help="open-loop rate as a fraction of the capacity measured first")
@click.option("--capacity", "capacity_s", default=20.0, show_default=True,
              help="seconds of the closed loop that measures capacity")
@click.option("--capacity-concurrency", default=8, show_default=True)
@click.option("--max-tokens", default=16, show_default=True,
              help="of plain requests and of streams read to the end")
@click.option("--cut-max-tokens", default=64, show_default=True,
              help="of the streams the client cuts after 2-4 chunks")
@click.option("--upload-interval", "upload_interval_s", default=15.0, show_default=True,
              help="seconds between adapter uploads during the load")
@click.option("--rss-slack-mib", default=512, show_default=True,
              help="RSS growth over the baseline still taken for no leak")
@click.option("--seed", default=0, show_default=True)
@click.option("--database-url", default=None,
              help="a fresh database (migrated first) [default: SQLite in a temporary "
                   "directory]")
@click.option("--redis-url", default=None,
              help="Redis quotas; this Redis database is FLUSHED before the run [default: "
                   "per-process quotas]")
@click.option("--serve-arg", "serve_args", multiple=True, help="extra flag for `serve`")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/soak-<timestamp>.json]",
)
def soak(serve_args: tuple[str, ...], **kwargs: Any) -> None:
    """Open-loop mixed traffic (plain, streams, cut streams, bad requests, adapter uploads)
    at a fraction of measured capacity; fails on leaked memory, descriptors, threads, KV
    blocks, pinned adapters, DB connections, Redis keys, or usage rows != responses."""
    from bench.soak.run import SoakOptions, run_soak

    report = run_soak(
        SoakOptions(serve_args=[a for arg in serve_args for a in arg.split()], **kwargs)
    )
    if not report.ok:
        raise SystemExit(1)


@bench.command("long-prompts")
@click.option("--model", default="default", show_default=True)
@click.option("--long-requests", default=3, show_default=True)
@click.option("--long-prompt-len", default=8000, show_default=True)
@click.option("--long-output-len", default=8, show_default=True)
@click.option("--long-interval", "long_interval_s", default=20.0, show_default=True,
              help="seconds between long prompts")
@click.option("--short-rate", default=0.5, show_default=True, help="short prompts per second")
@click.option("--short-prompt-len", default="32-96", show_default=True, help="min-max tokens")
@click.option("--short-output-len", default=16, show_default=True)
@click.option("--setting", "settings", multiple=True,
              type=click.Choice(["unchunked", "uncapped", "capped"]),
              default=("unchunked", "uncapped", "capped"), show_default=True,
              help="one server per setting")
@click.option("--seed", default=0, show_default=True)
@click.option("--serve-arg", "serve_args", multiple=True,
              help="extra flag for `serve` [default: --max-num-batched-tokens 512 "
                   "--kv-cache-tokens 40960]")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="JSON report")
def long_prompts(
    short_prompt_len: str, serve_args: tuple[str, ...], **kwargs: Any
) -> None:
    """Short prompts' TTFT while 8k-token prompts arrive, with the long-prefill cap and
    without (same arrivals), and the throughput of each."""
    from bench.long_prompts import LongPromptOptions, run_long_prompts

    options = LongPromptOptions(short_prompt_len=_range(short_prompt_len), **kwargs)
    if serve_args:
        options.serve_args = [a for arg in serve_args for a in arg.split()]
    run_long_prompts(options)


@bench.command("grammar")
@click.option("--model", default="default", show_default=True)
@click.option("--library", "libraries", multiple=True,
              type=click.Choice(["xgrammar", "llguidance"]),
              default=("xgrammar", "llguidance"), show_default=True)
@click.option("--batch-size", default=32, show_default=True)
@click.option("--steps", default=256, show_default=True, help="timed decode steps, mixed run")
@click.option("--case-steps", default=96, show_default=True,
              help="timed decode steps of each case alone (0: none)")
@click.option("--compile-runs", default=10, show_default=True)
@click.option("--repeats", default=2, show_default=True,
              help="mixed runs per library, alternating libraries")
@click.option("--hostile-timeout", "hostile_timeout_s", default=30.0, show_default=True,
              help="seconds per hostile grammar before its worker is killed")
@click.option("--seed", default=0, show_default=True)
@click.option("--quick", is_flag=True, help="a short run that checks everything works")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/grammar-<timestamp>.json]",
)
def grammar(libraries: tuple[str, ...], **kwargs: Any) -> None:
    """xgrammar vs llguidance: compile time, per-step mask time for a batch, bitmask apply,
    GIL overlap with a matmul, hostile grammars; every generated document validated."""
    from bench.grammar.run import GrammarOptions, run_grammar

    run_grammar(GrammarOptions(libraries=libraries, **kwargs))


@bench.command("structured")
@click.option("--model", default="default", show_default=True)
@click.option("--num-adapters", default=8, show_default=True,
              help="random adapters of the step-time load (--max-loras the same)")
@click.option("--rank", default=16, show_default=True)
@click.option("--num-requests", default=32, show_default=True,
              help="concurrent streams of each load; half of the first load constrained")
@click.option("--max-tokens", default=64, show_default=True, help="per stream, ignore_eos")
@click.option("--repeats", default=3, show_default=True,
              help="rounds of each load, alternating which goes first")
@click.option("--compile-runs", default=20, show_default=True)
@click.option("--schema-requests", default=50, show_default=True)
@click.option("--tool-requests", default=50, show_default=True)
@click.option("--validity-concurrency", default=8, show_default=True)
@click.option("--validity-max-tokens", default=384, show_default=True)
@click.option("--adapters-dir", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None,
              help="PEFT adapters for the validity checks [default: the demo adapters, "
                   "trained once if not cached]")
@click.option("--seed", default=0, show_default=True)
@click.option("--quick", is_flag=True, help="a short run that checks everything works")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report [default: bench/results/structured-<timestamp>.json]",
)
def structured(**kwargs: Any) -> None:
    """Constrained decoding: TPOT with half the rows under a JSON schema vs none (same
    run), grammar compile times cold and cached, and schema / tool-call validity on the
    demo adapters; fails when an answer is not valid."""
    from bench.structured.run import StructuredOptions, run_structured

    report = run_structured(StructuredOptions(**kwargs))
    if not report.validity.ok:
        raise SystemExit(1)
