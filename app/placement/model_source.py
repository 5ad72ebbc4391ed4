"""The base model's config for planning: dimensions only, never the weights.

`"default"` reads the converted SmolLM2 directory under `<data_dir>/models/` when it exists,
else the bundled GGUF file's header (the metadata the llama.cpp converter wrote from the same
config.json), so planning never pays for a conversion. A path is a Hugging Face model
directory (or its config.json); its weights need not be present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.models.loader import (
    DEFAULT_MODEL_NAME,
    ModelConfig,
    ModelLoadError,
    bundled_gguf_path,
    load_model_config,
    parse_model_config,
)

# GGUF architecture -> Hugging Face model_type, for the architectures the engine serves.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}


def planning_model_config(model: str, data_dir: Path) -> tuple[ModelConfig, str]:
    """(config, where it was read from) for `--model default|PATH`."""
    if model == "default":
        cached = Path(data_dir) / "models" / DEFAULT_MODEL_NAME / "config.json"
        if cached.is_file():
            return load_model_config(cached.parent), str(cached)
        gguf = bundled_gguf_path()
        return gguf_model_config(gguf), str(gguf)
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    return load_model_config(path), str(path / "config.json")


def gguf_model_config(path: Path) -> ModelConfig:
    """A ModelConfig from a GGUF file's metadata (memory-mapped; tensors are not read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {e}") from e

    def field(key: str) -> Any:
        value = reader.fields.get(key)
        return None if value is None else value.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}")
    tokens = field("tokenizer.ggml.tokens")
    raw: dict[str, Any] = {
        "model_type": _GGUF_ARCHITECTURES[arch],
        "vocab_size": field(f"{arch}.vocab_size") or (len(tokens) if tokens else None),
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
        "head_dim": field(f"{arch}.attention.key_length"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6,
        "rope_theta": field(f"{arch}.rope.freq_base") or 10000.0,
        # llama.cpp writes no output.weight when the lm_head is the embedding matrix.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
    }
    return parse_model_config(raw, source=str(path))
