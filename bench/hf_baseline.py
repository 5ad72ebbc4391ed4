"""Hugging Face `generate` on the same requests: the baseline every engine figure is divided by."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness.workload import BenchRequest


@dataclass(slots=True)
class HFResult:
    mode: str
    num_requests: int
    output_tokens: int
    wall_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict[str, float | str]:
        return {
            "mode": self.mode,
            "requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
        }


def load_hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def load_peft(base: Any, adapters: dict[str, Path]) -> Any:
    """`base` wrapped by PEFT (in place) with every adapter loaded under its name."""
    from peft import PeftModel

    (first, first_dir), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, str(first_dir), adapter_name=first)
    for name, path in rest:
        model.load_adapter(str(path), adapter_name=name)
    model.eval()
    return model


def _device(model: Any) -> torch.device:
    """Where the model's weights are (inputs go there; HF leaves that to the caller)."""
    return next(model.parameters()).device


def _greedy_kwargs(model: Any, max_new_tokens: int) -> dict[str, object]:
    # min_new_tokens == max_new_tokens: same output lengths as the engine's ignore_eos.
    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id
    return {
        "do_sample": False,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "pad_token_id": pad,
    }


@torch.inference_mode()
def run_one_at_a_time(model: Any, requests: list[BenchRequest], *, peft: bool = False) -> HFResult:
    """peft: `model` is a PeftModel; each request runs alone on its adapter (set_adapter)."""
    start = time.perf_counter()
    tokens = 0
    for r in requests:
        if peft:
            model.set_adapter(r.model)
        ids = torch.tensor([r.prompt_token_ids], device=_device(model))
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **_greedy_kwargs(model, r.max_tokens),
        )
        tokens += out.shape[1] - ids.shape[1]
    mode = "peft_one_at_a_time" if peft else "hf_one_at_a_time"
    return HFResult(mode, len(requests), tokens, time.perf_counter() - start)


@torch.inference_mode()
def run_static_batches(
    model: Any, requests: list[BenchRequest], batch_size: int, *, peft: bool = False
) -> HFResult:
    """Left-padded static batches; a batch runs until its longest request is done.

    Only each request's own max_tokens count as delivered output. peft: `model` is a
    PeftModel and a batch mixes the requests' adapters (`adapter_names`).
    """
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        prompts = [r.prompt_token_ids for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = _greedy_kwargs(model, max(r.max_tokens for r in batch))
        if peft:
            kwargs["adapter_names"] = [r.model for r in batch]
        device = _device(model)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        tokens += sum(r.max_tokens for r in batch)
    mode = f"{'peft' if peft else 'hf'}_static_batch_{batch_size}"
    return HFResult(mode, len(requests), tokens, time.perf_counter() - start)
