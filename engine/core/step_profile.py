"""The largest step an engine's settings allow, run once at startup so that the peak
memory of a real step can be measured before the KV cache is sized (ModelRunner on CUDA)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.lora.layers import LoRASlots
from engine.lora.weights import LoRAModule, LoRAWeights
from engine.models.attention import AttentionMetadata, PrefillSequence, allocate_kv_cache
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from loraplex_kernels.reference import LoRASegments


def run_largest_step(
    model: CausalLM,
    lora: LoRASlots | None,
    config: EngineConfig,
    model_config: ModelConfig,
    *,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """max_num_batched_tokens prompt tokens over max_num_seqs sequences (each sampling,
    through the sampler's copies), spread over every LoRA slot when there are slots, against
    a scratch KV cache just large enough for it. Returns the scratch cache's bytes."""
    bs = config.block_size
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
    num_seqs = min(config.max_num_seqs, num_tokens)
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    num_blocks = sum(-(-n // bs) for n in lens)
    mc = model_config
    scratch = allocate_kv_cache(
        mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, dtype, device
    )
    prefills: list[PrefillSequence] = []
    slots: list[int] = []
    token_slots: list[int] = []
    row = block = 0
    for i, n in enumerate(lens):
        ids = list(range(block, block + -(-n // bs)))
        prefills.append(PrefillSequence(
            query_start=row, query_len=n, context_len=n,
            block_ids=torch.tensor(ids, dtype=torch.long, device=device),
        ))
        slots.extend(ids[p // bs] * bs + p % bs for p in range(n))
        token_slots.extend([i % lora.num_slots if lora is not None else -1] * n)
        row, block = row + n, block + len(ids)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=0, decode_block_tables=None, decode_context_lens=None,
        prefills=prefills, block_size=bs, decode_group_sizes=None,
    )
    positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=device)
    sample = torch.tensor([p.query_start + p.query_len - 1 for p in prefills], device=device)
    used_slots = sorted(set(token_slots) - {-1})
    if lora is not None:
        adapter = zero_adapter(lora, dtype)
        for slot in used_slots:
            lora.install(slot, adapter)
    try:
        with torch.inference_mode():
            hidden = model(
                torch.zeros(num_tokens, dtype=torch.long, device=device),
                positions,
                metadata,
                scratch,
                LoRASegments.from_token_slots(token_slots, device),
            )
            # The sampler's float32 logits, probabilities and sorted copy (top-p).
            logits = model.compute_logits(hidden[sample])
            torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    finally:
        for slot in used_slots:
            assert lora is not None
            lora.clear(slot)
    return num_blocks * bs * _kv_bytes_per_token(mc, dtype)


def zero_adapter(lora: LoRASlots, dtype: torch.dtype) -> LoRAWeights:
    """An all-zero adapter of the slots' max rank on every module they carry."""
    rank = lora.max_rank
    weights = LoRAWeights("profile", None, rank, float(rank), False)
    for layer, by_name in enumerate(lora.groups):
        for name, group in by_name.items():
            modules = lora.group_modules[name]
            for module, size in zip(modules, group.slice_sizes, strict=True):
                weights.modules[(layer, module)] = LoRAModule(
                    a=torch.zeros(rank, group.in_features, dtype=dtype),
                    b=torch.zeros(size, rank, dtype=dtype),
                    scaling=1.0,
                )
    return weights


def _kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * mc.num_layers * mc.kv_size * torch.empty((), dtype=dtype).element_size()
