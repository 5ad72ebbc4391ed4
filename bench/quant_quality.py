"""`loraplex bench quant-quality`: perplexity of a fixed text under each weight
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

from bench.harness.options import opt
from bench.harness.report import save_report
from bench.lora import resolve_model
from engine.config import QuantizationSpec

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"


@dataclass(slots=True)
class QuantQualityOptions:
    model: str = opt("default", "'default' (bundled SmolLM2) or a local HF directory")
    text: Path = opt(DEFAULT_TEXT, "the text scored", shown="tests/data/perplexity.txt")
    schemes: tuple[str, ...] = opt(("none", "int8", "int4", "int4:64", "int8:32"),
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
                        module.weight, spec.bits, spec.group_for(module.in_features)).nbytes
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

