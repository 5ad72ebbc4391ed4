"""The GPU check's plans (what each mode runs) and its random-weight model directories,
written offline.

No weights travel to the device machine, so every model is built from a Hugging Face
config with seeded random weights (on the GPU when there is one), saved as safetensors,
and given a word-level tokenizer made in code: the engine needs tokenizer files, the
prompts are token ids, so any tokenizer that covers the vocabulary will do.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, replace
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

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        kv = h // self.num_attention_heads * self.num_key_value_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers * per_layer + self.vocab_size * h + head + h

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        settings = asdict(self)  # rope_scaling copied: HF may change the dict it is given
        del settings["name"]
        return LlamaConfig(
            **settings, rms_norm_eps=1e-5, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID
        )


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


# ---------------------------------------------------------------------------- plans
# What each mode runs. The defaults are the GPU plan's, planned to fit one H200 in 8
# minutes (not measured there yet; budget_s and run.sh's limit bound the run); the dry
# run's sizes run the same code on two CPU cores in well under a minute.

Batch = tuple[str, int, int, str]  # kernel_checks.BatchSpec's fields


@dataclass(frozen=True, slots=True)
class IdentityPlan:
    shape: ModelShape = SMOLLM2_135M
    num_prompts: int = 10
    prompt_len: tuple[int, int] = (16, 300)
    new_tokens: int = 32
    adapter_ranks: tuple[int, ...] = (8, 16, 32, 64)  # one adapter each, targets alternating
    kv_cache_tokens: int = 65536


@dataclass(frozen=True, slots=True)
class ThroughputPlan:
    shape: ModelShape = LLAMA3_8B
    dtype: torch.dtype = torch.bfloat16
    concurrency: tuple[int, ...] = (64, 256)  # engine runs of this many sequences at once
    prompt_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (64, 128)
    hf_batch_size: int = 64  # HF / PEFT static batches of at most this many requests
    adapter_counts: tuple[int, ...] = (16, 64)  # multi-LoRA runs over this many adapters
    lora_requests: int = 64
    lora_prompt_len: tuple[int, int] = (64, 256)
    lora_output_len: tuple[int, int] = (16, 32)
    lora_rank: int = 16
    overhead_adapters: int = 16  # the LoRA-overhead run: rows round robin over this many
    decode_batch_sizes: tuple[int, ...] = (64, 256)
    decode_prompt_len: int = 64
    decode_timed_steps: int = 16


@dataclass(frozen=True, slots=True)
class Plan:
    dry_run: bool = False
    test_select: str | None = None  # pytest -k for tests/gpu; None: all of them
    tests_timeout_s: float = 300.0  # the quantized engines against HF took it past 240 s
    # hidden, intermediate, q size, kv size: Llama-3-8B's
    kernel_dims: tuple[int, int, int, int] = (4096, 14336, 4096, 1024)
    accuracy_batches: tuple[Batch, ...] = (
        ("decode-256-distinct", 256, 1, "distinct"),
        ("decode-256-skewed", 256, 1, "skewed"),
        ("prefill-16x128-skewed", 16, 128, "skewed"),
    )
    bandwidth_batches: tuple[Batch, ...] = (
        ("decode-256-distinct", 256, 1, "distinct"),
        ("decode-64-distinct", 64, 1, "distinct"),
    )
    copy_bytes: int = 2 * 2**30
    timing_warmup: int = 5
    timing_iters: int = 20
    identity: IdentityPlan = IdentityPlan()
    throughput: ThroughputPlan = ThroughputPlan()
    budget_s: float = 420.0  # a step is not started past this many seconds from the start


GPU_PLAN = Plan()
DRY_RUN_PLAN = Plan(
    dry_run=True,
    # Two of the Triton kernel tests (all of them take ~10-20 s in the interpreter here),
    # the kernels at the plan's shapes and the engine against HF, the quantized kernel at
    # the plan's shapes and the quantized engines against HF.
    test_select=("strided_activation_views or slot_without_any_adapted_slice "
                 "or serving_shapes or engine_matches_hf or quant_kernel_at_model_shapes "
                 "or quantized_engine_greedy"),
    tests_timeout_s=180.0,
    kernel_dims=(32, 48, 32, 16),
    accuracy_batches=(
        ("decode-4-distinct", 4, 1, "distinct"),
        ("prefill-2x20-skewed", 2, 20, "skewed"),
    ),
    bandwidth_batches=(("decode-4-distinct", 4, 1, "distinct"),),
    copy_bytes=4 * 2**20,
    timing_warmup=1,
    timing_iters=2,
    identity=IdentityPlan(
        shape=TINY_SMOLLM2,
        num_prompts=3,
        prompt_len=(4, 12),
        new_tokens=4,
        adapter_ranks=(8, 16),
        kv_cache_tokens=1024,
    ),
    throughput=ThroughputPlan(
        shape=TINY_LLAMA3,
        dtype=torch.float32,
        concurrency=(4, 8),
        prompt_len=(8, 24),
        output_len=(4, 8),
        hf_batch_size=4,
        adapter_counts=(2, 4),
        lora_requests=4,
        lora_prompt_len=(8, 16),
        lora_output_len=(3, 5),
        overhead_adapters=2,
        decode_batch_sizes=(4,),
        decode_prompt_len=8,
        decode_timed_steps=3,
    ),
    budget_s=300.0,
)
