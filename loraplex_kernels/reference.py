"""Plain-torch semantics of the model's custom ops; the CPU path runs these directly.

Shapes: T flattened tokens of a step, H query heads, KVH key/value heads, D head_dim,
NB cache blocks of BS token slots each. The KV cache of one layer is a pair of tensors
`[NB, BS, KVH, D]`; token slot `s` lives at block `s // BS`, offset `s % BS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [T, HID], weight [HID]
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies [D / 2] in float32, with optional linear or llama3 scaling."""
    # NOTE: float32 throughout, like the reference checkpoints' own code, so the cos/sin
    # tables match bit for bit and greedy outputs do not drift on near-ties.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / factor
    assert rope_type == "llama3", rope_type
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between blended linearly in 1/wavelength.
    old_len = original_max_position_embeddings
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [P, D / 2] for positions 0..P-1."""
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope. x [T, N, D]; cos, sin [T, 1, D / 2] -> [T, N, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def interleave_rope_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}] as [x_0, y_0, x_1, ...].

    weight [N * D, ...] (a q or k projection's weight or bias). Attention scores are
    unchanged when q and k share the permutation, and rotate-half rope on the original
    layout equals `apply_rope_interleaved` on the permuted one.
    """
    rows = weight.shape[0]
    assert rows % head_dim == 0 and head_dim % 2 == 0, (weight.shape, head_dim)
    halves = weight.reshape(rows // head_dim, 2, head_dim // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def apply_rope_interleaved(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rope on pair-interleaved heads. x [T, N, D] (pairs (2i, 2i+1)); rope [T, 1, D / 2]
    complex cos + i sin -> [T, N, D]. Same values as apply_rope on the unpermuted layout."""
    num_tokens, num_heads, head_dim = x.shape
    # Complex views exist for float32/float64 only: bf16/fp16 heads rotate in float32.
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    pairs = torch.view_as_complex(wide.reshape(num_tokens, num_heads, head_dim // 2, 2))
    out = torch.view_as_real(pairs * rope).reshape(num_tokens, num_heads, head_dim)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value [T, KVH, D] go to slots slot_mapping [T] of the caches [NB, BS, KVH, D]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def decode_attention_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[S, 1, 1, L] bool: True where a key position is inside the sequence."""
    positions = torch.arange(max_len, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, attending to its whole cached context.

    query [S, H, D]; block_tables [S, M] (padding entries may be any valid block id);
    context_lens [S] (including the query token, already written); mask: a precomputed
    `decode_attention_mask(context_lens, M * BS)`. Returns [S, H, D].
    """
    block_size = key_cache.shape[1]
    max_len = block_tables.shape[1] * block_size
    if mask is None:
        mask = decode_attention_mask(context_lens, max_len)
    # index_select on the flat table copies whole blocks and is several times faster on
    # CPU than advanced indexing.
    flat = block_tables.reshape(-1)
    keys = key_cache.index_select(0, flat)  # [S * M, BS, KVH, D]
    values = value_cache.index_select(0, flat)
    return decode_attention_gathered(query, keys, values, mask, scale)


def decode_attention_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over blocks already gathered in block-table order.

    query [S, H, D]; keys, values [S * M, BS, KVH, D] (sequence s owns blocks
    s*M .. s*M + M - 1); mask [S, 1, 1, M * BS]. Returns [S, H, D].
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    shape = (num_seqs, -1, num_kv_heads, head_dim)
    k = keys.view(shape).transpose(1, 2)  # [S, KVH, L, D]
    v = values.view(shape).transpose(1, 2)
    # Grouped-query attention without copying K/V per query head: the query heads that
    # share a KV head become that head's rows ([S, KVH, G, D]).
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """[Q, C] bool: query i sits at position C - Q + i and sees keys 0..C - Q + i."""
    ones = torch.ones(query_len, context_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=context_len - query_len)


# causal_attention pads sequences of other dtypes than float32 to a multiple of this.
CAUSAL_PAD = 16


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """A sequence with nothing cached before it. query [Q, H, D]; key, value [Q, KVH, D]."""
    q, k, v = _heads_first(query, key, value, repeat_kv=False)
    length = q.shape[1]
    padded = -(-length // CAUSAL_PAD) * CAUSAL_PAD
    if q.dtype != torch.float32 and padded != length:
        # NOTE: torch's CPU flash kernel is up to 2x slower on lengths that are not a
        # multiple of 16 (its tail blocks): over prompts of 20-400 tokens in bf16, padding
        # to one saves a third of the kernel's time. Zero rows after the last token change
        # nothing the causal mask lets a real token see, but the kernel's blocking moves
        # with the length, so sums round differently: float32 keeps the unpadded call, bit
        # for bit what Hugging Face's model computes.
        q, k, v = (F.pad(t, (0, 0, 0, padded - length)) for t in (q, k, v))
    # NOTE: 4-D inputs: torch's CPU flash kernel only takes batched heads; 3-D inputs
    # fall back to the unfused math path, 2-3x slower on long prompts. enable_gqa: each
    # query head reads its KV head in place, with the same sums as repeated K/V (bit for
    # bit) and without the copies (~4% of a 2,048-token bf16 prefill step).
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=_gqa(q, k)
    )
    return out[0, :, :length].transpose(0, 1)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The last Q tokens of a sequence of context_len tokens, all of whose K/V are cached.

    query [Q, H, D]; block_ids [>= ceil(C / BS)]; mask: a precomputed
    `prefill_attention_mask(Q, C)`. Returns [Q, H, D].
    """
    query_len = query.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_blocks = -(-context_len // block_size)
    ids = block_ids[:num_blocks]
    key = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:context_len]
    value = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:context_len]
    if mask is None:
        mask = prefill_attention_mask(query_len, context_len, query.device)
    q, k, v = _heads_first(query, key, value, repeat_kv=False)
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=_gqa(q, k)
    )
    return out[0].transpose(0, 1)


def _gqa(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether SDPA must map query heads [H, ...] onto fewer KV heads [KVH, ...]."""
    return query.shape[0] != key.shape[0]


def _heads_first(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, repeat_kv: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # [N, heads, D] -> [heads, N, D]; repeat_kv: K/V repeated so each query head has its own.
    groups = query.shape[1] // key.shape[1]
    key, value = key.transpose(0, 1), value.transpose(0, 1)
    if groups > 1 and repeat_kv:
        key = key.repeat_interleave(groups, dim=0)
        value = value.repeat_interleave(groups, dim=0)
    return query.transpose(0, 1), key, value


def dense_causal_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unpaged, unfused semantics for tests: query [Q, H, D] are the last Q of the C keys
    key, value [C, KVH, D]. Returns [Q, H, D]."""
    query_len, context_len = query.shape[0], key.shape[0]
    q, k, v = _heads_first(query.float(), key.float(), value.float())
    scores = q @ k.transpose(1, 2) * scale  # [H, Q, C]
    visible = prefill_attention_mask(query_len, context_len, query.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)


# ---- multi-LoRA (Punica / S-LoRA style) ----------------------------------------------
#
# A LoRA "group" is one fused linear of the model (qkv, o, gate_up, down) with NSL output
# slices (3, 1, 2, 1). Its slot-stacked buffers, for NS adapter slots of rank at most R:
#
#   lora_a    [NS, NSL, R, IN]   slot s, slice k: rows [0, ranks[s, k]) hold A (rank x IN)
#   lora_b    [NS, OUT, R]       rows slice_offsets[k]:slice_offsets[k + 1] of slot s hold
#                                slice k's B (OUT_k x rank) in columns [0, ranks[s, k])
#   ranks     [NS, NSL] int32    0: the slot's adapter does not touch that slice (or no adapter)
#   scalings  [NS, NSL] float32  alpha / r (alpha / sqrt(r) for rsLoRA)
#   slice_offsets                NSL + 1 output column offsets, slice_offsets[-1] == OUT
#
# Tokens reach the kernels as segments (LoRASegments): the rows of x that have an adapter,
# grouped by slot. Tokens with no adapter are in no segment and are never touched. Compute
# is rank-aware: a slot of rank r reads and multiplies r rows, never R.


@dataclass(frozen=True, slots=True)
class LoRASegments:
    """Which rows of a step use which adapter slot, grouped by slot (one segment each)."""

    token_indices: torch.Tensor  # [N] int64: rows of x with an adapter, grouped by slot
    # [G + 1] int32: segment g is token_indices[seg_starts[g] : seg_starts[g + 1]]
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor  # [G] int32: the slot of each segment
    segments: tuple[tuple[int, int, int], ...]  # host copy: (start, end, slot) per segment
    max_seg_len: int
    # [G, 3] int64 on the host: the segments as a table (the CPU kernels read it)
    seg_table: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_indices.shape[0])

    @classmethod
    def from_token_slots(
        cls, token_slots: list[int], device: torch.device | str = "cpu"
    ) -> LoRASegments | None:
        """token_slots[t]: the slot of row t, -1 for none. None when no row has an adapter."""
        rows_by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                rows_by_slot.setdefault(slot, []).append(row)
        if not rows_by_slot:
            return None
        indices: list[int] = []
        segments: list[tuple[int, int, int]] = []
        for slot in sorted(rows_by_slot):
            rows = rows_by_slot[slot]
            segments.append((len(indices), len(indices) + len(rows), slot))
            indices.extend(rows)
        starts = [s for s, _, _ in segments] + [len(indices)]
        return cls(
            token_indices=torch.tensor(indices, dtype=torch.int64, device=device),
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_slots=torch.tensor([s for _, _, s in segments], dtype=torch.int32, device=device),
            segments=tuple(segments),
            max_seg_len=max(end - start for start, end, _ in segments),
            seg_table=torch.tensor(segments, dtype=torch.int64),
        )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    segs: LoRASegments,
) -> torch.Tensor:
    """x [T, IN] -> float32 [N, NSL, R]: row i is x[token_indices[i]] @ A_{s,k}^T for its
    segment's slot s and every slice k, in columns [0, ranks[s, k]); zeros elsewhere."""
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros(segs.num_tokens, num_slices, max_rank, dtype=torch.float32, device=x.device)
    rank_table = ranks.tolist()
    rows = x.index_select(0, segs.token_indices)
    for start, end, slot in segs.segments:
        xs = rows[start:end].float()
        for k, r in enumerate(rank_table[slot]):
            if r:
                out[start:end, k, :r] = xs @ lora_a[slot, k, :r].float().t()
    return out


def lora_expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...],
    segs: LoRASegments,
) -> None:
    """In place: y[token_indices[i], slice k] += scalings[s, k] * shrunk[i, k, :r] @ B_{s,k}^T
    with r = ranks[s, k], accumulated in float32. y [T, OUT]; shrunk [N, NSL, R]."""
    rank_table, scale_table = ranks.tolist(), scalings.tolist()
    delta = torch.zeros(segs.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for start, end, slot in segs.segments:
        for k, r in enumerate(rank_table[slot]):
            if r:
                lo, hi = slice_offsets[k], slice_offsets[k + 1]
                b = lora_b[slot, lo:hi, :r].float()
                delta[start:end, lo:hi] = (shrunk[start:end, k, :r] @ b.t()) * scale_table[slot][k]
    y.index_add_(0, segs.token_indices, delta.to(y.dtype))


@dataclass(frozen=True, slots=True)
class PackedLoRA:
    """One slot of one LoRA group in the CPU layout: for each adapted slice k, its A_k
    [r_k, IN] and B_k^T [r_k, OUT_k], both contiguous, with its scaling and its column
    window lo_k:hi_k = slice_offsets[k]:slice_offsets[k + 1] of the group's output.

    NOTE: no copy of the adapter. The host cache keeps each B as the transpose of a
    contiguous B^T (engine/lora/peft.py), so A_k and B_k^T are views of the tensors the
    host cache holds, and an adapter in a CPU slot costs no memory beyond its host copy.
    """

    slices: tuple[tuple[torch.Tensor, torch.Tensor, float, int, int], ...]  # a, b_t, s, lo, hi

    @property
    def num_elements(self) -> int:
        return sum(a.numel() + b_t.numel() for a, b_t, _, _, _ in self.slices)


def pack_lora_slot(
    slices: list[tuple[torch.Tensor, torch.Tensor, float] | None],
    slice_offsets: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> PackedLoRA | None:
    """slices[k]: (A [r, IN], B [OUT_k, r], scaling) or None -> PackedLoRA (None if empty).
    Views of A and B where their layout and dtype allow, copies otherwise."""
    packed: list[tuple[torch.Tensor, torch.Tensor, float, int, int]] = []
    for k, piece in enumerate(slices):
        if piece is None:
            continue
        a, b_k, scaling = piece
        a = a.to(device=device, dtype=dtype).contiguous()
        b_t = b_k.t().to(device=device, dtype=dtype).contiguous()
        packed.append((a, b_t, float(scaling), slice_offsets[k], slice_offsets[k + 1]))
    return PackedLoRA(slices=tuple(packed)) if packed else None


def add_lora_packed(
    y: torch.Tensor,
    x: torch.Tensor,
    packed: list[PackedLoRA | None],
    segs: LoRASegments,
) -> None:
    """lora_expand(y, lora_shrink(x, ...), ...) over slots in the PackedLoRA layout: the CPU
    path. For each segment of slot s and each adapted slice k:
    y[rows, lo_k:hi_k] += ((x[rows] @ A_k^T) @ B_k^T) * scaling_k. Same operation order as
    PEFT (x A^T, then B^T, then the scaling)."""
    live = [(start, end, packed[slot]) for start, end, slot in segs.segments]
    if all(p is None for _, _, p in live):
        return
    rows = x.index_select(0, segs.token_indices)
    delta = torch.zeros(segs.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    for start, end, slot_lora in live:
        if slot_lora is None:
            continue
        xs = rows[start:end]
        for a, b_t, scaling, lo, hi in slot_lora.slices:
            out = delta[start:end, lo:hi]
            torch.mm(torch.mm(xs, a.t()), b_t, out=out)
            out.mul_(scaling)
    y.index_add_(0, segs.token_indices, delta)
