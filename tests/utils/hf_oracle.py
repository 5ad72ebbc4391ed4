"""Hugging Face transformers as the oracle: greedy continuations of one prompt alone."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def _hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[int]:
    """Token ids HF generates after the prompt, EOS included when it stops on one."""
    model = _hf_model(str(model_dir))
    ids = torch.tensor([prompt_token_ids])
    kwargs: dict[str, object] = {}
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    eos = model.generation_config.eos_token_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=eos if isinstance(eos, int) else (eos[0] if eos else 0),
        **kwargs,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]
