"""Paged attention over the flattened tokens of one step: the cache, the metadata, the op.

A step's T tokens are laid out decodes first (one token per decoding sequence), then
prefill chunks, each a contiguous run of one sequence's tokens. Every layer writes the
step's new K/V into the cache first, then attends by reading the cache, so a chunk sees
its own tokens and everything cached earlier (prefix-cache hits, previous chunks) alike.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass, field

import torch

from loraplex_kernels import cpu_attention, cpu_decode, cpu_ops
from loraplex_kernels import reference as ref


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
    *,
    prefault: bool = False,
) -> list[LayerKVCache]:
    """prefault (CPU): every page backed now, not as blocks are first written."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NOTE: zeros, not empty: padded block-table entries point at real blocks, and a
    # masked-out garbage NaN would still poison softmax(...) @ V through 0 * NaN.
    zeros = (functools.partial(_mapped_zeros, prefault=prefault) if device.type == "cpu"
             else functools.partial(torch.zeros, device=device))
    return [
        LayerKVCache(key=zeros(shape, dtype=dtype), value=zeros(shape, dtype=dtype))
        for _ in range(num_layers)
    ]


def _mapped_zeros(shape: tuple[int, ...], *, dtype: torch.dtype, prefault: bool) -> torch.Tensor:
    """A zero CPU tensor on an anonymous mapping: backed page by page as it is first
    written, or (prefault) all at once now.

    NOTE: torch.zeros writes every byte, so a CPU cache of 65,536 SmolLM2 tokens cost 2.9
    GB of RSS from startup. An anonymous mapping reads as zeros and is backed page by page
    as blocks are first written: RSS follows the blocks used (the prefix cache keeps them).
    But each first write is a page fault inside a step, and in a server process (many
    threads) those cost far more than in a bare loop: on a 2-core VM the K/V writes of a
    32-row bf16 decode step took 5.2 ms with faults against 0.6 ms without, and the served
    burst of docs/BENCHMARKS.md was ~10% faster with the cache prefaulted. MAP_POPULATE
    backs the mapping in one call, with the same zeros.
    """
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private, so that a forked child gets copy-on-write pages, not a shared cache. The
    # tensor holds a reference to the mapping, which is unmapped with its storage.
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
    buffer = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


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
class DecodeGroup:
    """Decode rows [start, start + count) attending through one padded block table."""

    start: int
    count: int
    block_tables: torch.Tensor  # [count, width] long
    context_lens: torch.Tensor  # [count] long
    mask: torch.Tensor  # [count, 1, 1, width * block_size] bool
    # Its blocks' place in AttentionMetadata.decode_gather: [offset, offset + count * width).
    gather_offset: int
    gather_len: int


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each token's K/V
    num_decode_tokens: int  # the first D tokens, one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [D] long, including the decoded token
    prefills: list[PrefillSequence]
    block_size: int = 16
    # Split of the D decode rows into consecutive groups, each padded only to its own
    # longest context; None: one group. The runner sorts decodes by length for this.
    decode_group_sizes: list[int] | None = None
    # Built once per step for all layers: the groups, and every group's padded block
    # table flattened into one index, so a layer gathers all decode K/V in one copy.
    decode_groups: list[DecodeGroup] = field(init=False)
    decode_gather: torch.Tensor | None = field(init=False)
    max_decode_len: int = field(init=False)  # the longest decode context (0: none)

    def __post_init__(self) -> None:
        # paged_attention concatenates outputs in this order, so the layout must be exact.
        offset = self.num_decode_tokens
        for seq in self.prefills:
            assert seq.query_start == offset, (seq.query_start, offset)
            offset += seq.query_len
        assert offset == self.slot_mapping.shape[0], (offset, self.slot_mapping.shape)
        self.decode_groups = []
        self.decode_gather = None
        self.max_decode_len = 0
        if self.num_decode_tokens == 0:
            return
        tables, lens = self.decode_block_tables, self.decode_context_lens
        assert tables is not None and lens is not None
        assert tables.shape[0] == self.num_decode_tokens
        self.max_decode_len = int(lens.max())
        sizes = self.decode_group_sizes or [self.num_decode_tokens]
        assert sum(sizes) == self.num_decode_tokens, (sizes, self.num_decode_tokens)
        bs = self.block_size
        start = offset = 0
        flat: list[torch.Tensor] = []
        for count in sizes:
            group_lens = lens[start : start + count]
            width = -(-int(group_lens.max()) // bs)
            group_tables = tables[start : start + count, :width]
            self.decode_groups.append(
                DecodeGroup(
                    start=start,
                    count=count,
                    block_tables=group_tables,
                    context_lens=group_lens,
                    mask=ref.decode_attention_mask(group_lens, width * bs),
                    gather_offset=offset,
                    gather_len=count * width,
                )
            )
            flat.append(group_tables.reshape(-1))
            start += count
            offset += count * width
        self.decode_gather = flat[0] if len(flat) == 1 else torch.cat(flat)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def _writable_in_one_call(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache) -> bool:
    """Each token's heads of key and value [T, KVH, D] are one contiguous row, and the
    cache's slots too (what `cpu_ops.write_kv` takes)."""
    head_dim = key.shape[2]
    return (
        all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (key, value))
        and cache.key.is_contiguous()
        and cache.value.is_contiguous()
    )


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (rope applied) -> [T, H, D]."""
    if cpu_ops.available(key.device, key.dtype) and _writable_in_one_call(key, value, cache):
        cpu_ops.write_kv(key, value, cache.key, cache.value, meta.slot_mapping)
    else:
        ref.write_kv_cache(key, value, cache.key, cache.value, meta.slot_mapping)
    outs: list[torch.Tensor] = []
    if meta.num_decode_tokens and cpu_decode.available(query.device, query.dtype):
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        # NOTE: on the CPU, decode rows read K/V in place through their block tables:
        # the gather below copies every decode's blocks per layer and step.
        outs.append(
            cpu_decode.paged_decode_attention(
                query[: meta.num_decode_tokens],
                cache.key,
                cache.value,
                meta.decode_block_tables,
                meta.decode_context_lens,
                meta.max_decode_len,
                scale,
            )
        )
    elif meta.decode_gather is not None:
        keys = cache.key.index_select(0, meta.decode_gather)  # [sum of widths, BS, KVH, D]
        values = cache.value.index_select(0, meta.decode_gather)
        for g in meta.decode_groups:
            blocks = slice(g.gather_offset, g.gather_offset + g.gather_len)
            outs.append(
                ref.decode_attention_gathered(
                    query[g.start : g.start + g.count], keys[blocks], values[blocks], g.mask, scale
                )
            )
    kernel = (bool(meta.prefills) and query.dtype == torch.bfloat16
              and query.device.type == "cpu" and cpu_attention.fits(query.shape[2])
              and cpu_attention.available())
    for seq in meta.prefills:
        span = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.mask is None:
            # NOTE: a fresh bf16 prompt on AMX tiles or AVX-512 BF16 dot products where the
            # CPU has them: a third (AMX) to 3.6x (Zen 4) less time than torch's flash
            # kernel over a 2,048-token step's prompts (the same rounding of the
            # probabilities to bf16 before their product with V).
            attend = cpu_attention.causal_attention if kernel else ref.causal_attention
            outs.append(attend(query[span], key[span], value[span], scale))
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
