"""Tiny random Hugging Face checkpoints (written by `transformers`) for fast model tests.

Every model uses the SmolLM2 vocabulary so the real tokenizer files can be copied in.
Weights are seeded and drawn wide (initializer_range 0.2) so greedy picks are never
near-ties; biases and norm weights, which HF initializes to constants, are randomized
too so that loading them into the wrong place would show.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMOLLM2_VOCAB = 49152

BASE_SETTINGS: dict[str, Any] = {
    "vocab_size": SMOLLM2_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}

# name -> (model_type, overrides of BASE_SETTINGS)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("llama", {}),
    # Room for tool definitions rendered into the prompt.
    "llama_long": ("llama", {"max_position_embeddings": 2048}),
    "llama_mha_untied": (
        "llama",
        {"num_key_value_heads": 4, "tie_word_embeddings": False, "rope_theta": 500.0},
    ),
    "llama_attention_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 5000.0,
        },
    ),
    "llama_linear_rope": (
        "llama",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 1000.0},
    ),
    "qwen2_bias": ("qwen2", {"tie_word_embeddings": False}),
    # The window is larger than the model length, so full attention is exact here.
    "mistral": ("mistral", {"sliding_window": 4096, "head_dim": 24}),
    # Heads wider than hidden_size / num_heads: q_size (128) is not hidden_size.
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3_bias_untied": (
        "qwen3",
        {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": False},
    ),
    # Phi3Config's default pad id (32000) would be outside the small vocabularies tests use.
    "phi3": ("phi3", {"tie_word_embeddings": False, "rope_theta": 2000.0, "pad_token_id": None}),
}


def _hf_config(model_type: str, settings: dict[str, Any]) -> Any:
    from transformers import (
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
        "qwen3": Qwen3Config,
        "phi3": Phi3Config,
    }[model_type]
    return cls(**settings)


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def make_tiny_model(
    out_dir: Path,
    tokenizer_dir: Path,
    variant: str = "llama_gqa",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random model of `variant` (see VARIANTS) plus tokenizer into out_dir."""
    from transformers import AutoModelForCausalLM

    model_type, variant_settings = VARIANTS[variant]
    settings = {**BASE_SETTINGS, **variant_settings, **overrides}
    config = _hf_config(model_type, settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out_dir), **kwargs)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def random_prompt(length: int, seed: int, vocab_size: int = SMOLLM2_VOCAB) -> list[int]:
    """Token ids away from the special tokens at the start of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (length,), generator=g).tolist()
