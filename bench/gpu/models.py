"""Random-weight model directories for the GPU check, written offline.

No weights travel to the device machine, so every model is built from a Hugging Face
config with seeded random weights (on the GPU when there is one), saved as safetensors,
and given a word-level tokenizer made in code: the engine needs tokenizer files, the
prompts are token ids, so any tokenizer that covers the vocabulary will do.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family config, as the `transformers.LlamaConfig` keyword arguments."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Wide weights keep greedy picks far from ties (as tests/utils/tiny_models.py does).
    initializer_range: float = 0.2
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        kv = h // self.num_attention_heads * self.num_key_value_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers * per_layer + self.vocab_size * h + head + h

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        settings: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": 1e-5,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            **self.extra,
        }
        if self.rope_scaling is not None:
            settings["rope_scaling"] = dict(self.rope_scaling)
        return LlamaConfig(**settings)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# SmolLM2-135M: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536.
SMOLLM2_135M = ModelShape(
    name="smollm2-135m-random",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
# Llama-3-8B: 32 layers, hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336.
# The throughput model: its weights are drawn at HF's default scale, as a trained model's
# magnitudes matter less there than its shapes.
LLAMA3_8B = ModelShape(
    name="llama3-8b-random",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling=LLAMA3_ROPE,
    initializer_range=0.02,
)
# Dry-run stand-ins: the same families (vocabulary, GQA, tying, rope) at toy widths.
TINY_SMOLLM2 = replace(
    SMOLLM2_135M,
    name="smollm2-tiny-random",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_LLAMA3 = replace(
    LLAMA3_8B,
    name="llama3-tiny-random",
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 256},
)


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` tokens: <unk>, <s>, </s>, then t3, t4, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # pieces joined by spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out_dir))


def build_random_model(
    shape: ModelShape,
    out_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> Any:
    """Draw a random HF model of `shape` on `device` in `dtype`, write it (safetensors,
    config, tokenizer) to out_dir, and return the model, still on the device, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)
    if shape.initializer_range >= 0.1:
        # Norm weights are constants in HF's init: randomized, a wrongly loaded norm shows.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.eval()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.save_pretrained(str(out_dir), max_shard_size="4GB")
    write_tokenizer(out_dir, shape.vocab_size)
    return model


def scratch_dir(needed_bytes: int, fallback: Path) -> Path:
    """/dev/shm when it has room for `needed_bytes` (twice over), else `fallback`: a
    16 GB checkpoint is written and read back faster from memory than from disk."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return fallback
    work = shm / "loraplex-gpu-check"
    shutil.rmtree(work, ignore_errors=True)  # left by a run that was killed
    try:
        return work if shutil.disk_usage(shm).free > 2 * needed_bytes else fallback
    except OSError:
        return fallback
