"""What the engine reads from a model's config.json, shared by every architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelLoadError(Exception):
    """A model directory cannot be served; the message says what is wrong with it."""


@dataclass(slots=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3"
    factor: float
    # llama3 only: the frequency bands that are kept, scaled, or blended.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ArchFields:
    """The config fields an architecture reads its own way (see CausalLM.arch_fields)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # The attention window every layer is limited to, or None for full attention.
    sliding_window: int | None = None


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    sliding_window: int | None
    # The longest sequence this engine serves: max_position_embeddings, or the sliding
    # window when it is shorter (full attention equals sliding attention inside it).
    max_model_len: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def window_of(raw: dict[str, Any]) -> int | None:
    """config.json's `sliding_window` when it is a positive size, else None."""
    window = raw.get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


def switched_window(raw: dict[str, Any]) -> int | None:
    """The window of configs that switch it on per model or per layer (Qwen2, Qwen3)."""
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or "sliding_attention" in layer_types:
        return window_of(raw)
    return None
