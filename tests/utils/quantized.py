"""The oracle of a quantized engine: a checkpoint whose weights are the dequantized ones."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import QuantizationSpec
from engine.models.quantized import round_trip_hf_linears
from tests.utils.tiny_models import copy_tokenizer

# The decoder linear layers the engine quantizes (Hugging Face's names).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_checkpoint(model_dir: Path, out_dir: Path, spec: QuantizationSpec) -> Path:
    """model_dir's model with every decoder linear weight replaced by the values its
    quantization stands for, saved to out_dir (tokenizer included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert round_trip_hf_linears(model, spec) == 7 * model.config.num_hidden_layers
    model.save_pretrained(str(out_dir))
    copy_tokenizer(model_dir, out_dir)
    return out_dir
