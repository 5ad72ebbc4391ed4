"""Paged attention over the flattened tokens of one step: the cache, the metadata, the op.

A step's T tokens are laid out decodes first (one token per decoding sequence), then
prefill chunks, each a contiguous run of one sequence's tokens. Every layer writes the
step's new K/V into the cache first, then attends by reading the cache, so a chunk sees
its own tokens and everything cached earlier (prefix-cache hits, previous chunks) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import reference as ref


@dataclass(slots=True)
class LayerKVCache:
    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # same shape as key


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[LayerKVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NOTE: zeros, not empty: padded block-table entries point at real blocks, and a
    # masked-out garbage NaN would still poison softmax(...) @ V through 0 * NaN.
    return [
        LayerKVCache(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


@dataclass(slots=True)
class PrefillSequence:
    """One sequence's chunk of query tokens after the decode tokens."""

    query_start: int  # offset of its first token in the step's flattened tokens
    query_len: int
    # Tokens of this sequence with K/V after this step: cached before + query_len. Its
    # query token i sits at position context_len - query_len + i.
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long
    # [query_len, context_len] bool, built once per step for all layers; None when
    # nothing was cached before the chunk (plain causal over the chunk's own K/V).
    mask: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        assert 0 < self.query_len <= self.context_len, (self.query_len, self.context_len)
        if self.context_len == self.query_len:
            self.mask = None
        else:
            self.mask = ref.prefill_attention_mask(
                self.query_len, self.context_len, self.block_ids.device
            )


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each token's K/V
    num_decode_tokens: int  # the first D tokens, one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [D] long, including the decoded token
    prefills: list[PrefillSequence]
    # [D, 1, 1, max_blocks * block_size] bool, built once per step for all layers.
    decode_mask: torch.Tensor | None = field(init=False)
    block_size: int = 16

    def __post_init__(self) -> None:
        # paged_attention concatenates outputs in this order, so the layout must be exact.
        offset = self.num_decode_tokens
        for seq in self.prefills:
            assert seq.query_start == offset, (seq.query_start, offset)
            offset += seq.query_len
        assert offset == self.slot_mapping.shape[0], (offset, self.slot_mapping.shape)
        if self.num_decode_tokens == 0:
            self.decode_mask = None
            return
        assert self.decode_block_tables is not None and self.decode_context_lens is not None
        assert self.decode_block_tables.shape[0] == self.num_decode_tokens
        max_len = self.decode_block_tables.shape[1] * self.block_size
        self.decode_mask = ref.decode_attention_mask(self.decode_context_lens, max_len)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (rope applied) -> [T, H, D]."""
    ref.write_kv_cache(key, value, cache.key, cache.value, meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    decode_out: torch.Tensor | None = None
    if num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        decode_out = ref.paged_decode_attention(
            query[:num_decodes],
            cache.key,
            cache.value,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.decode_mask,
        )
        if not meta.prefills:
            return decode_out
    outs = [] if decode_out is None else [decode_out]
    for seq in meta.prefills:
        span = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.mask is None:
            outs.append(ref.causal_attention(query[span], key[span], value[span], scale))
        else:
            outs.append(
                ref.paged_prefill_attention(
                    query[span],
                    cache.key,
                    cache.value,
                    seq.block_ids,
                    seq.context_len,
                    scale,
                    seq.mask,
                )
            )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
