"""Driving an in-process `EngineCore` and Hugging Face models on the same token-id
requests, for the engine steps of the GPU check."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.harness.workload import BenchRequest
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.request import EngineRequest, SamplingParams


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
) -> EngineCore:
    """kv_cache_tokens None: the engine sizes its cache from the device (on CUDA a share of
    the memory free after loading the weights, see engine/core/model_runner.py)."""
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=max_num_seqs,
            kv_cache_tokens=kv_cache_tokens,
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, 1),
            max_lora_rank=max_lora_rank,
            data_dir=data_dir,
        )
    )


@dataclass(slots=True)
class EngineRun:
    """Requests run to completion: their output tokens, wall time and steps."""

    tokens: dict[str, list[int]]
    wall_s: float
    num_steps: int
    step_s: list[float] = field(default_factory=list)  # each step's wall time

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


def run_engine(
    core: EngineCore, requests: list[EngineRequest], *, time_steps: bool = False
) -> EngineRun:
    """All requests added at once, stepped until every one has finished."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step_s: list[float] = []
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    steps = 0
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        result = core.step()
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        if time_steps:
            step_s.append(time.perf_counter() - t0)
        steps += 1
        if result.failures:
            request_id, exc = next(iter(result.failures.items()))
            raise RuntimeError(f"engine request {request_id} failed: {exc}") from exc
    return EngineRun(tokens, time.perf_counter() - start, steps, step_s)


def close_core(core: EngineCore) -> None:
    """Stop the engine's adapter loader, which would otherwise keep it (and its KV cache)
    alive after the caller drops it."""
    if core.adapter_cache is not None:
        core.adapter_cache.close()


def release() -> None:
    """Return the device memory of what the caller dropped to the driver, so that the
    next step sizes its KV cache from it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- Hugging Face


def _pad_id(model: Any) -> int:
    eos = model.generation_config.eos_token_id
    return eos if isinstance(eos, int) else (eos[0] if eos else 0)


@torch.inference_mode()
def hf_greedy(model: Any, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy token ids HF `generate` gives after the prompt alone (EOS included when it
    stops on one), on the model's device."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_token_ids], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=_pad_id(model),
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


@torch.inference_mode()
def hf_teacher_forced_top1(
    model: Any, prompt_token_ids: list[int], continuation: list[int]
) -> list[int]:
    """The model's argmax after prompt + continuation[:k], for every k, in one forward."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_token_ids + continuation[:-1]], device=device)
    logits = model(input_ids=ids).logits[0]  # [L, V]
    first = len(prompt_token_ids) - 1
    return logits[first : first + len(continuation)].argmax(-1).tolist()


def load_peft(base: Any, adapters: dict[str, Path]) -> Any:
    """`base` wrapped by PEFT (in place) with every adapter loaded under its name."""
    from peft import PeftModel

    (first, first_dir), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, str(first_dir), adapter_name=first)
    for name, path in rest:
        model.load_adapter(str(path), adapter_name=name)
    model.eval()
    return model
