"""The quantized base weights' benchmarks.

`loraplex bench quant-kernels`: the linear layers of a step of SmolLM2's shapes (each
layer's own weights, so that they come from memory as in a step) in oneDNN at float32 and
bf16, in torch's weight-only int8 / int4 kernels, and in ours (weight-only int8 / int4,
and w8a8), at each row count.

`loraplex bench quant-quality`: perplexity of a fixed text under each weight
quantization scheme, and each scheme's weight bytes.

Each scheme's perplexity is computed by transformers on the weights the engine serves
under it (engine/models/quantized.py round_trip_hf_linears: every decoder linear layer
replaced by the values its integers stand for), in float32 over the whole text at once.
tests/engine/test_quantized_engine.py holds the engine to those weights' logprobs within
1e-4 nats per token (measured 1e-5 to 3e-5), so this is the served model's perplexity.

NOTE: the bundled SmolLM2 ships as a Q4_1 GGUF: its "none" is already the GGUF's 4-bit
values, expanded; int4 with groups of 32 re-quantizes them on Q4_1's own grid (a scale
and the minimum per 32 inputs), so it should come out the same model.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness.options import opt
from bench.harness.report import save_report
from bench.lora import resolve_model
from engine.config import QuantizationSpec

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"


# A Llama layer of SmolLM2-135M: (out, in) of qkv, o, gate_up, down.
SMOLLM2_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


@dataclass(slots=True)
class QuantKernelsOptions:
    rows: tuple[int, ...] = opt((1, 8, 32, 128, 512), flag="--rows")
    layers: int = opt(30, "layers of SmolLM2's shapes")
    repeats: int = opt(5, "the best of this many passes is kept")
    torch_kernels: bool = opt(True, "also torch's _weight_int8pack_mm / _weight_int4pack_mm")
    output: Path | None = opt(None, "JSON report",
                              shown="bench/results/quant-kernels-<timestamp>.json")


def run_quant_kernels(options: QuantKernelsOptions) -> dict[str, dict[str, float]]:
    import torch

    from engine.models.cpu_linear import packing_available
    from loraplex_kernels import cpu_gemm, cpu_qdot, cpu_quant

    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in SMOLLM2_LAYER]
               for _ in range(options.layers)]
    flat = [w for layer in weights for w in layer]
    ways: dict[str, list] = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        if not packing_available(torch.device("cpu"), dtype):
            # NOTE: oneDNN packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT); the
            # engine serves such CPUs with plain matmuls, so those are what is timed.
            cast = [w.to(dtype) for w in flat]
            ways[f"torch {name}"] = [
                (dtype, lambda x, w=w: torch.nn.functional.linear(x, w)) for w in cast]
            continue
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 32) for w in flat]
        ways[f"oneDNN {name}"] = [
            (dtype, lambda x, p=p: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [None], "")) for p in packed]
    for bits, group in ((8, None), (4, 32)):
        quantized = [cpu_quant.quantize(w, bits, group) for w in flat]
        ways[f"ours int{bits}"] = [(torch.float32, lambda x, q=q: cpu_quant.linear(x, q))
                                   for q in quantized]
        if bits == 8:  # bf16 rows: how int8 runs at bf16 without AVX-512 VNNI
            ways["ours int8 (bf16 rows)"] = [
                (torch.bfloat16, lambda x, q=q: cpu_quant.linear(x, q)) for q in quantized]
    if cpu_gemm.available():
        # What an unquantized bf16 model's linears run on AVX-512 BF16 CPUs.
        packed_bf16 = [cpu_gemm.pack_weight(w.to(torch.bfloat16)) for w in flat]
        ways["ours bf16 (unquantized)"] = [
            (torch.bfloat16, lambda x, p=p, n=w.shape[0]: cpu_gemm.linear(x, p, n))
            for p, w in zip(packed_bf16, flat, strict=True)]
    # int8 as served at bf16 on VNNI CPUs: the same integers against 16-bit activations.
    ways["ours int8, wide activations (bf16)"] = [
        (torch.bfloat16, lambda x, q=q: cpu_qdot.linear(x, q))
        for q in (cpu_qdot.pack(*cpu_quant.quantize_integers(w, 8, None)[:2], wide=True)
                  for w in flat)]
    # w8a8: int8 weights and int8 activations (bf16 rows in, as served on VNNI CPUs).
    ways["ours w8a8 (bf16)"] = [
        (torch.bfloat16, lambda x, q=q: cpu_qdot.linear(x, q))
        for q in (cpu_qdot.quantize(w) for w in flat)]
    if options.torch_kernels:
        int8 = []
        int4 = []
        for w in flat:
            scale = w.abs().amax(1) / 127
            q = torch.round(w / scale[:, None]).to(torch.int8)
            scale16 = scale.bfloat16()
            int8.append((torch.bfloat16, lambda x, q=q, s=scale16:
                         torch._weight_int8pack_mm(x, q, s)))
            n, k = w.shape
            wg = w.reshape(n, k // 32, 32)
            lo, hi = wg.amin(-1), wg.amax(-1)
            step = ((hi - lo) / 15).clamp(min=1e-8)
            q4 = torch.round((wg - lo[..., None]) / step[..., None]).clamp(0, 15)
            int4_weight = torch._convert_weight_to_int4pack_for_cpu(q4.reshape(n, k).int(), 1)
            # torch's convention: w = (q - 8) * scale + zero.
            scale_zero = torch.stack([step.t(), (lo + 8 * step).t()], -1).bfloat16()
            int4.append((torch.bfloat16, lambda x, p=int4_weight, sz=scale_zero:
                         torch._weight_int4pack_mm_for_cpu(x, p, 32, sz)))
        ways["torch int8 (bf16)"] = int8
        ways["torch int4 (bf16)"] = int4
    report: dict[str, dict[str, float]] = {}
    for rows in options.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        report[str(rows)] = {}
        for name, calls in ways.items():
            best = float("inf")
            for _ in range(options.repeats):
                start = time.perf_counter()
                for (dtype, call), w in zip(calls, flat, strict=True):
                    call(xs[w.shape[1]].to(dtype))
                best = min(best, time.perf_counter() - start)
            report[str(rows)][name] = round(best * 1e3, 2)
        print(f"{rows:5d} rows: " + ", ".join(f"{k} {v} ms" for k, v in report[str(rows)].items()),
              flush=True)
    save_report({"options": {**asdict(options), "output": None if options.output is None
                             else str(options.output)},
                 "started_at": time.time(), "ms_per_step_of_layers": report},
                "quant-kernels", options.output)
    return report


@dataclass(slots=True)
class QuantQualityOptions:
    model: str = opt("default", "'default' (bundled SmolLM2) or a local HF directory")
    text: Path = opt(DEFAULT_TEXT, "the text scored", shown="tests/data/perplexity.txt")
    schemes: tuple[str, ...] = opt(("none", "int8", "int4", "int4:64", "int8:32", "w8a8"),
                                   "SCHEME or SCHEME:GROUP_SIZE")
    output: Path | None = opt(None, "JSON report",
                              shown="bench/results/quant-quality-<timestamp>.json")


@dataclass(slots=True)
class SchemeQuality:
    scheme: str
    perplexity: float
    vs_none: float  # perplexity / the unquantized model's
    linear_bytes: int  # the decoder linear layers' weights as the engine holds them
    linear_bytes_vs_float32: float


def _spec(text: str) -> QuantizationSpec:
    scheme, _, group = text.partition(":")
    return QuantizationSpec(scheme, int(group) if group else None)


def run_quant_quality(options: QuantQualityOptions) -> list[SchemeQuality]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.quantized import HF_LINEARS, round_trip_hf_linears
    from loraplex_kernels import cpu_quant

    model_dir, _ = resolve_model(options.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = torch.tensor([tokenizer(options.text.read_text())["input_ids"]])
    started = time.time()
    results: list[SchemeQuality] = []
    base_ppl = None
    for text in options.schemes:
        spec = _spec(text)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
        linear_bytes = 0
        float_bytes = 0
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in HF_LINEARS:
                float_bytes += module.weight.numel() * 4
                if spec.enabled:
                    linear_bytes += cpu_quant.quantize(
                        module.weight, spec.bits, spec.group).nbytes
                else:
                    linear_bytes += module.weight.numel() * 4
        if spec.enabled:
            round_trip_hf_linears(model, spec)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
        ppl = math.exp(nll)
        base_ppl = base_ppl or (ppl if not spec.enabled else None)
        results.append(SchemeQuality(
            scheme=spec.describe(), perplexity=round(ppl, 4),
            vs_none=round(ppl / base_ppl, 5) if base_ppl else float("nan"),
            linear_bytes=linear_bytes,
            linear_bytes_vs_float32=round(linear_bytes / float_bytes, 4)))
        print(f"{spec.describe():24s} perplexity {ppl:8.4f}  linear weights "
              f"{linear_bytes / 2**20:7.1f} MiB ({linear_bytes / float_bytes:.3f}x float32)",
              flush=True)
    print(f"{ids.shape[1]} tokens of {options.text}")
    save_report({
        "options": {**asdict(options), "text": str(options.text),
                    "output": None if options.output is None else str(options.output)},
        "tokens": int(ids.shape[1]),
        "started_at": started,
        "results": [asdict(r) for r in results],
    }, "quant-quality", options.output)
    return results



@dataclass(slots=True)
class QuantLoadOptions:
    model: str = opt("default", "'default' (bundled SmolLM2) or a local HF directory")
    schemes: tuple[str, ...] = opt(("none", "int8", "int4"), "SCHEME or SCHEME:GROUP_SIZE")
    dtype: str = opt("float32", "the serving dtype")
    output: Path | None = opt(None, "JSON report",
                              shown="bench/results/quant-load-<timestamp>.json")


# Run in a fresh interpreter per scheme, so that each peak RSS is its own.
_LOAD_PROBE = """
import json, resource, sys, time
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
model, dtype, scheme, group = sys.argv[1:5]
import torch  # the interpreter's own memory before the model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
core = EngineCore(EngineConfig(model=model, dtype=dtype, quantization=scheme,
                               quantization_group_size=int(group) or None,
                               kv_cache_tokens=256, max_loras=1, max_num_seqs=4))
seconds = time.perf_counter() - start
runner = core.runner
print(json.dumps({
    "load_s": round(seconds, 2),
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "rss_before_mib": round(before / 1024, 1),
    "weight_bytes": runner.weight_bytes,
    "source": "gguf blocks" if runner.gguf_source else
              ("checkpoint" if runner.checkpoint_scheme else "float checkpoint"),
}))
"""


def run_quant_load(options: QuantLoadOptions) -> list[dict[str, Any]]:
    """Each scheme's load in a fresh process: seconds to a ready engine (a 256-token KV
    cache, so that the weights dominate), peak RSS, weight bytes."""
    import json
    import subprocess
    import sys

    model_dir, _ = resolve_model(options.model)
    results: list[dict[str, Any]] = []
    for text in options.schemes:
        spec = _spec(text)
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_PROBE, str(model_dir), options.dtype, spec.scheme,
             str(spec.group_size or 0)], capture_output=True, text=True, check=True)
        row: dict[str, Any] = {"scheme": spec.describe(),
                               **json.loads(done.stdout.strip().splitlines()[-1])}
        results.append(row)
        print(f"{spec.describe():24s} load {row['load_s']:5.2f} s  peak RSS "
              f"{row['peak_rss_mib']:7.1f} MiB (interpreter {row['rss_before_mib']} MiB)  "
              f"weights {row['weight_bytes'] / 2**20:6.1f} MiB  from {row['source']}",
              flush=True)
    save_report({"options": {**asdict(options), "output": None if options.output is None
                             else str(options.output)},
                 "started_at": time.time(), "results": results}, "quant-load", options.output)
    return results
