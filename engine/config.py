"""Engine settings: one dataclass, filled by the CLI or by tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_data_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_DATA_DIR", "./var"))


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"  # "default" (bundled SmolLM2) or a local HF directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # KV cache capacity in tokens; None sizes it from the device (CPU: enough for
    # max_num_seqs sequences of max_model_len, capped).
    kv_cache_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_lora_rank: int = 64
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores
    # CPU float32: run linear layers on oneDNN-packed weights (see engine/models/cpu_linear.py).
    pack_cpu_weights: bool = True
    data_dir: Path | None = None  # None: LORAPLEX_DATA_DIR or ./var

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                f"of {self.block_size} tokens"
            )

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir()
