"""`loraplex bench ...`: the benchmarks, as click commands. Each command's options come
from its options dataclass (bench/harness/options.py), the one place of their defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from bench.evals import EvalImpactOptions
from bench.fairness import FairnessOptions, run_fairness
from bench.gateway.run import GatewayOptions, run_gateway
from bench.grammar.run import GrammarOptions
from bench.harness.options import options_command
from bench.kernels import KernelsOptions
from bench.long_prompts import LongPromptOptions
from bench.lora import LoRABenchOptions
from bench.prefill import PrefillAttentionOptions
from bench.quantization import QuantKernelsOptions, QuantLoadOptions, QuantQualityOptions
from bench.roofline import RooflineOptions
from bench.serve.options import ServeOptions
from bench.soak.run import SoakOptions, run_soak
from bench.structured.run import StructuredOptions
from bench.throughput import ThroughputOptions


@click.group("bench")
def bench() -> None:
    """Run the benchmarks in bench/ (figures go to docs/BENCHMARKS.md)."""


@bench.command("throughput")
@options_command(ThroughputOptions)
def throughput(options: ThroughputOptions) -> None:
    """N concurrent streams through the server vs HF generate on the same requests."""
    from bench.throughput import run_throughput

    run_throughput(options)


@bench.command("roofline")
@options_command(RooflineOptions)
def roofline(options: RooflineOptions) -> None:
    """Matmul peak and memory bandwidth, and a decode step's parts against them."""
    from bench.roofline import run_roofline

    run_roofline(options)


@bench.command("prefill-attention")
@options_command(PrefillAttentionOptions)
def prefill_attention(options: PrefillAttentionOptions) -> None:
    """A new prompt's bf16 attention: torch's flash kernel vs loraplex's, and a prefill step."""
    from bench.prefill import run_prefill_attention

    run_prefill_attention(options)


@bench.command("kernels")
@options_command(KernelsOptions)
def kernels(options: KernelsOptions) -> None:
    """Triton lora_shrink / lora_expand vs the torch reference and gather-bmm (CUDA only)."""
    from bench.kernels import run_kernels

    run_kernels(options)


@bench.command("gateway")
@options_command(GatewayOptions)
def gateway(options: GatewayOptions) -> None:
    """Gateway overhead: chat requests (keys, Redis quotas, metering) against an engine
    that answers instantly, vs GET /health, open loop at --rate; then a closed loop."""
    run_gateway(options)


# The options only some LoRA benchmarks take (the others leave them out).
_COLD = ("lora-cold-load", "lora-cold-ttft")
_LORA_ONLY = {"zipf_alpha": ("lora-scaling",), "hf_batch_size": ("lora-vs-peft",),
              "loads": _COLD, "store": _COLD, "store_burst": _COLD}


def _lora_command(name: str) -> Callable[[Callable[[Any], None]], Callable[..., None]]:
    return options_command(
        LoRABenchOptions, exclude=tuple(f for f, cmds in _LORA_ONLY.items() if name not in cmds)
    )


@bench.command("lora-scaling")
@_lora_command("lora-scaling")
def lora_scaling(options: LoRABenchOptions) -> None:
    """N concurrent requests on 1 adapter vs N distinct adapters (uniform, Zipf)."""
    from bench.lora import run_scaling

    run_scaling(options)


@bench.command("lora-vs-peft")
@_lora_command("lora-vs-peft")
def lora_vs_peft(options: LoRABenchOptions) -> None:
    """The server vs Hugging Face PEFT (one at a time, static mixed batches)."""
    from bench.lora import run_vs_peft

    run_vs_peft(options)


@bench.command("lora-overhead")
@_lora_command("lora-overhead")
def lora_overhead(options: LoRABenchOptions) -> None:
    """Step time with every request on one adapter vs on the base model."""
    from bench.lora import run_overhead

    run_overhead(options)


@bench.command("lora-cold-load")
@_lora_command("lora-cold-load")
def lora_cold_load(options: LoRABenchOptions) -> None:
    """An adapter from disk to ready (p50/p99) vs PEFT's load_adapter."""
    from bench.lora import run_cold_load

    run_cold_load(options)


@bench.command("lora-cold-ttft")
@_lora_command("lora-cold-ttft")
def lora_cold_ttft(options: LoRABenchOptions) -> None:
    """Time to first token, served, for an adapter warm, cold on local disk, and cold in
    the object store (--store), and a burst of cold ones; the base model as baseline."""
    from bench.lora import run_cold_ttft

    run_cold_ttft(options)


@bench.command("eval-impact")
@options_command(EvalImpactOptions)
def eval_impact(options: EvalImpactOptions) -> None:
    """Short chat requests' time to first token without an adapter eval and while one
    runs (p99 ratio)."""
    from bench.evals import run_eval_impact

    run_eval_impact(options)


@bench.command("serve")
@options_command(ServeOptions)
def serve(options: ServeOptions) -> None:
    """Open-loop streams at each --rate (Poisson or gamma arrivals): TTFT, TPOT, ITL, e2e
    percentiles, throughput and goodput within the SLOs; KV, queue and RSS of loraplex."""
    from bench.serve.run import run_serve

    run_serve(options)


@bench.command("quant-kernels")
@options_command(QuantKernelsOptions)
def quant_kernels(options: QuantKernelsOptions) -> None:
    """A step's linear layers (SmolLM2's shapes) in oneDNN float32 / bf16, torch's
    weight-only int8 / int4 kernels and ours, at each row count."""
    from bench.quantization import run_quant_kernels

    run_quant_kernels(options)


@bench.command("quant-load")
@options_command(QuantLoadOptions)
def quant_load(options: QuantLoadOptions) -> None:
    """Each --quantization scheme's load in a fresh process: seconds, peak RSS, weight
    bytes (quantized as the layers load, or read as stored)."""
    from bench.quantization import run_quant_load

    run_quant_load(options)


@bench.command("quant-quality")
@options_command(QuantQualityOptions)
def quant_quality(options: QuantQualityOptions) -> None:
    """Perplexity of a fixed text under each --quantization scheme (transformers on the
    weights each serves), and the decoder linear layers' bytes."""
    from bench.quantization import run_quant_quality

    run_quant_quality(options)


@bench.command("fairness")
@options_command(FairnessOptions)
def fairness(options: FairnessOptions) -> None:
    """Noisy neighbour through the HTTP API: one tenant floods, another probes; TTFT of
    each, with VTC fairness and with fcfs."""
    run_fairness(options)


@bench.command("soak")
@options_command(SoakOptions)
def soak(options: SoakOptions) -> None:
    """Open-loop mixed traffic (plain, streams, cut streams, bad requests, adapter uploads)
    at a fraction of measured capacity; fails on leaked memory, descriptors, threads, KV
    blocks, pinned adapters, DB connections, Redis keys, or usage rows != responses."""
    if not run_soak(options).ok:
        raise SystemExit(1)


@bench.command("long-prompts")
@options_command(LongPromptOptions)
def long_prompts(options: LongPromptOptions) -> None:
    """Short prompts' TTFT while 8k-token prompts arrive, with the long-prefill cap and
    without (same arrivals), and the throughput of each."""
    from bench.long_prompts import run_long_prompts

    run_long_prompts(options)


@bench.command("grammar")
@options_command(GrammarOptions)
def grammar(options: GrammarOptions) -> None:
    """xgrammar vs llguidance: compile time, per-step mask time for a batch, bitmask apply,
    GIL overlap with a matmul, hostile grammars; every generated document validated."""
    from bench.grammar.run import run_grammar

    run_grammar(options)


@bench.command("structured")
@options_command(StructuredOptions)
def structured(options: StructuredOptions) -> None:
    """Constrained decoding: TPOT with half the rows under a JSON schema vs none (same
    run), grammar compile times cold and cached, and schema / tool-call validity on the
    demo adapters; fails when an answer is not valid."""
    from bench.structured.run import run_structured

    if not run_structured(options).validity.ok:
        raise SystemExit(1)
