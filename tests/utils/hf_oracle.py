"""Hugging Face transformers as the oracle: greedy continuations of one prompt alone."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    _hook_activations(model, model_dir)
    model.eval()
    return model


# A checkpoint directory holding this file stands for a w8a8 engine: its model's decoder
# linears are fed their inputs quantized as w8a8 quantizes them (tests/utils/quantized.py).
INT8_ACTIVATIONS_MARKER = "int8-activations"


def _hook_activations(model: torch.nn.Module, model_dir: str) -> None:
    if (Path(model_dir) / INT8_ACTIVATIONS_MARKER).exists():
        from engine.models.quantized import hook_int8_activations

        assert hook_int8_activations(model) > 0


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[int]:
    """Token ids HF generates after the prompt, EOS included when it stops on one."""
    return _greedy(hf_model(str(model_dir)), prompt_token_ids, max_new_tokens, ignore_eos)


def _greedy(
    model: torch.nn.Module, prompt_token_ids: list[int], max_new_tokens: int, ignore_eos: bool
) -> list[int]:
    ids = torch.tensor([prompt_token_ids])
    kwargs: dict[str, object] = {}
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    eos = model.generation_config.eos_token_id
    out = model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=eos if isinstance(eos, int) else (eos[0] if eos else 0),
        **kwargs,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


@cache
def peft_model(model_dir: str, adapters: tuple[tuple[str, str], ...],
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """One base model with every adapter loaded under its name (PEFT `load_adapter`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    _hook_activations(base, model_dir)
    (first_name, first_dir), *rest = adapters
    model = PeftModel.from_pretrained(base, first_dir, adapter_name=first_name)
    for name, adapter_dir in rest:
        model.load_adapter(adapter_dir, adapter_name=name)
    model.eval()
    return model


@torch.inference_mode()
def peft_greedy(
    model_dir: Path,
    adapters: dict[str, Path],
    adapter: str,
    prompt_token_ids: list[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy token ids of Hugging Face PEFT running `adapter` alone (set_adapter)."""
    model = peft_model(
        str(model_dir), tuple(sorted((name, str(path)) for name, path in adapters.items()))
    )
    model.set_adapter(adapter)  # type: ignore[operator]
    return _greedy(model, prompt_token_ids, max_new_tokens, ignore_eos=False)
