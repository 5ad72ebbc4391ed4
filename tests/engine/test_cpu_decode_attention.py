"""The CPU decode attention kernel (loraplex_kernels/cpu_decode.py) against the torch paths.

Random paged layouts: every sequence's blocks scattered over a cache full of garbage,
context lengths from one token to several blocks, block sizes 1-32, MHA and GQA, head
dims that are and are not multiples of the kernel's 8 lanes, queries that are views.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.attention import AttentionMetadata, LayerKVCache, paged_attention
from loraplex_kernels import cpu_decode
from loraplex_kernels import reference as ref

pytestmark = pytest.mark.skipif(
    not cpu_decode.available(torch.device("cpu"), torch.float32),
    reason="no C compiler for the CPU decode kernel",
)


def _layout(
    lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A cache of garbage holding each sequence's K/V in scattered blocks; block tables
    padded with block 0 (garbage for every sequence but the one that owns it)."""
    gen = torch.Generator().manual_seed(seed)
    needed = sum(math.ceil(n / block_size) for n in lens)
    num_blocks = needed + 5
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values, tables = [], [], []
    for n in lens:
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        count = math.ceil(n / block_size)
        blocks, order = order[:count], order[count:]
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size
                              for i in range(n)])
        ref.write_kv_cache(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
        tables.append(blocks)
    width = max(len(t) for t in tables) + 1  # one more column of padding than needed
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return key_cache, value_cache, block_tables, keys, values


@pytest.mark.parametrize(
    ("lens", "block_size"),
    [
        ([1], 16),
        ([5, 1, 17, 33], 16),
        ([200, 431, 16, 15, 17, 500, 3], 16),
        ([7, 8, 9], 1),
        ([40, 2, 64, 65], 32),
        ([13, 4, 29], 4),
        ([3, 50, 17, 16, 1, 99, 64, 33, 8, 120], 16),  # enough for whole sequences per item
    ],
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 8), (9, 3, 64), (8, 1, 12), (6, 2, 20), (4, 2, 128)],
)
def test_kernel_matches_reference_and_dense(
    lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    key_cache, value_cache, tables, keys, values = _layout(
        lens, block_size, num_kv_heads, head_dim, seed=len(lens) * 31 + block_size
    )
    # A view like the model's: q heads are the leading heads of a fused q/k tensor.
    qk = torch.randn(len(lens), num_heads + num_kv_heads, head_dim)
    query = qk[:, :num_heads]
    context_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode_attention(
        query, key_cache, value_cache, tables, context_lens, max(lens), scale
    )
    expected = ref.paged_decode_attention(
        query, key_cache, value_cache, tables, context_lens, scale
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    for i in range(len(lens)):
        dense = ref.dense_causal_attention_reference(query[i : i + 1], keys[i], values[i], scale)
        torch.testing.assert_close(out[i : i + 1], dense, atol=2e-6, rtol=1e-5)


# The bf16 case runs the AVX-512 BF16 loop where the CPU has it: 16 rows read at once,
# stale rows past the context among them.
@pytest.mark.parametrize(
    ("dtype", "block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(torch.float32, 8, 4, 2, 16), (torch.bfloat16, 16, 9, 3, 64)],
)
def test_kernel_reads_only_each_sequences_own_tokens(
    dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Garbage past a context's end, in its last block and in the padding, changes nothing;
    a token inside it does."""
    lens = [5, 2 * block_size + 5]
    key_cache, value_cache, tables, _, _ = _layout(lens, block_size, num_kv_heads, head_dim,
                                                   seed=3)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    query = torch.randn(2, num_heads, head_dim).to(dtype)
    context_lens = torch.tensor(lens)

    def run() -> torch.Tensor:
        return cpu_decode.paged_decode_attention(
            query, key_cache, value_cache, tables, context_lens, max(lens), 0.25
        )

    before = run()
    assert before.isfinite().all()
    last = int(tables[0, 0])
    key_cache[last, 5:] = 1e4  # slots 5.. of sequence 0's only block: past its end
    value_cache[last, 5:] = float("nan")
    key_cache[int(tables[1, 2]), 5:] = float("nan")  # and of sequence 1's last block
    value_cache[int(tables[1, 2]), 5:] = float("inf")
    key_cache[int(tables[1, 3])] = float("nan")  # sequence 1's padding column
    torch.testing.assert_close(run(), before, rtol=0, atol=0)
    key_cache[int(tables[1, 2]), 4] += 1.0  # token 2 * block_size + 4 of sequence 1: its last
    after = run()
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert not torch.allclose(after[1], before[1])


def _decode_metadata(
    tables: torch.Tensor, lens: list[int], block_size: int, slots: list[int],
    group_sizes: list[int] | None,
) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(lens),
        prefills=[],
        block_size=block_size,
        decode_group_sizes=group_sizes,
    )


@pytest.mark.parametrize("group_sizes", [None, [2, 3]])
def test_paged_attention_uses_the_kernel_and_agrees_with_the_gather_path(
    monkeypatch: pytest.MonkeyPatch, group_sizes: list[int] | None
) -> None:
    """Through paged_attention (the model's call): the new token's K/V is written first,
    then read; the kernel path and the gathered-SDPA path give the same rows."""
    lens = [300, 250, 41, 40, 2]  # longest first, as the runner lays them out
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    key_cache, value_cache, tables, _, _ = _layout(
        lens, block_size, num_kv_heads, head_dim, seed=7
    )
    # This step's token of each sequence goes to its last position.
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for i, n in enumerate(lens)]
    query = torch.randn(len(lens), num_heads, head_dim)
    key = torch.randn(len(lens), num_kv_heads, head_dim)
    value = torch.randn(len(lens), num_kv_heads, head_dim)
    meta = _decode_metadata(tables, lens, block_size, slots, group_sizes)
    cache = LayerKVCache(key=key_cache.clone(), value=value_cache.clone())
    calls: list[int] = []
    kernel = cpu_decode.paged_decode_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_decode, "paged_decode_attention", counting)
    out = paged_attention(query, key, value, cache, meta, head_dim**-0.5)
    assert calls == [1]
    monkeypatch.setattr(cpu_decode, "available", lambda device, dtype: False)
    gathered_cache = LayerKVCache(key=key_cache.clone(), value=value_cache.clone())
    expected = paged_attention(query, key, value, gathered_cache, meta, head_dim**-0.5)
    assert calls == [1]  # the second call took the gather path
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(cache.key, gathered_cache.key, rtol=0, atol=0)


# Head dims 64 and 128 with blocks of 16 rows or more take the AVX-512 BF16 loops where
# the CPU has them (16 rows' scores at once, query heads of a KV head in groups of 3 for
# 64 and 2 for 128, the rest one by one; a block's rows past its last 16 one by one).
@pytest.mark.parametrize(
    ("lens", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [([1], 4, 4, 8, 16), ([200, 431, 16, 15, 17, 500, 3], 9, 3, 64, 16),
     ([40, 2, 65], 4, 2, 128, 16), ([3, 50, 17, 16, 1, 99, 64, 33, 8, 120], 6, 2, 20, 16),
     ([40, 2, 65, 97, 31], 8, 2, 64, 32), ([40, 2, 65, 97, 31], 4, 4, 64, 16),
     ([33, 130, 7], 6, 2, 128, 32), ([17, 48], 8, 1, 128, 16), ([19, 40], 4, 2, 64, 8)],
)
def test_bf16_kernel_matches_float32_attention_over_the_same_values(
    lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """bf16 query and cache read as they are, scores and softmax in float32: the output is
    float32 attention over the same (bf16) values, rounded once."""
    key_cache, value_cache, tables, _, _ = _layout(lens, block_size, num_kv_heads, head_dim,
                                                   seed=5)
    key_cache, value_cache = key_cache.bfloat16(), value_cache.bfloat16()
    qk = torch.randn(len(lens), num_heads + num_kv_heads, head_dim).bfloat16()
    query = qk[:, :num_heads]
    context_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode_attention(
        query, key_cache, value_cache, tables, context_lens, max(lens), scale
    )
    assert out.dtype == torch.bfloat16
    exact = ref.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(),
                                       tables, context_lens, scale)
    # Within one bf16 rounding of float32 attention (2^-8 relative, half an ulp, plus
    # float32's own differences in the sum's order).
    torch.testing.assert_close(out.float(), exact, rtol=2**-8 + 1e-5, atol=1e-5)
    assert (out == exact.bfloat16()).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "num_heads", "num_kv_heads", "head_dim"),
    [
        # whole sequences per work item, some shorter than the blocks the loop fetches ahead
        ([1, 40, 17, 5, 300, 16, 33, 2, 90, 64, 15, 200, 31, 7], 9, 3, 64),
        ([3, 129, 48], 8, 2, 128),  # few sequences: one KV head per work item
    ],
)
def test_any_number_of_threads_gives_the_same_output(
    lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Work items go to the threads one at a time (each taking its next one, and fetching
    its first blocks, before it ends the current): every item is done once, by whichever
    thread, so the output is the same bits with 1 to 5 threads, and the reference's."""
    key_cache, value_cache, tables, _, _ = _layout(lens, 16, num_kv_heads, head_dim, seed=11)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    query = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    context_lens = torch.tensor(lens)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(cpu_decode.paged_decode_attention(
                query, key_cache, value_cache, tables, context_lens, max(lens), 0.125))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    exact = ref.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(),
                                       tables, context_lens, 0.125)
    torch.testing.assert_close(outs[0].float(), exact, rtol=2**-8 + 1e-5, atol=1e-5)


def test_other_dtypes_keep_the_torch_path() -> None:
    assert not cpu_decode.available(torch.device("cpu"), torch.float16)
    assert not cpu_decode.available(torch.device("meta"), torch.float32)
