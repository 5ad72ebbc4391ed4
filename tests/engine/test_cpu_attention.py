"""A new bf16 prompt's causal attention (loraplex_kernels/cpu_attention.py), in both of its
variants (AVX-512 BF16 dot products; AMX tiles, where the CPU has them), against exact
attention in float32 and torch's flash kernel: within what torch's own kernel differs by;
causality; the prefill path choosing it for fresh bf16 prompts only; and its switch."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from loraplex_kernels import cpu_attention, cpu_build
from loraplex_kernels import reference as ref

VARIANTS = [
    pytest.param(False, marks=pytest.mark.skipif(
        not cpu_attention.available(), reason="no AVX-512 BF16 on this CPU"), id="dot"),
    pytest.param(True, marks=pytest.mark.skipif(
        not cpu_attention.uses_tiles(), reason="no AMX on this CPU"), id="tiles"),
]


def _qkv(length: int, heads: int, kv_heads: int, head_dim: int, seed: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one [L, (H + 2 KVH) D] bf16 projection, as the model hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(length, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).bfloat16()
    q = qkv[:, : heads * head_dim].view(length, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(length, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(length, kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("tiles", VARIANTS)
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 345])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 64), (8, 2, 128), (2, 1, 32), (4, 2, 96)])
def test_causal_attention_is_attention_to_bf16_rounding(
    tiles: bool, length: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, k, v = _qkv(length, heads, kv_heads, head_dim, seed=length + head_dim)
    scale = head_dim**-0.5
    got = cpu_attention.causal_attention(q, k, v, scale, tiles=tiles)
    assert got.shape == (length, heads, head_dim) and got.dtype == torch.bfloat16
    exact = ref.dense_causal_attention_reference(q.float(), k.float(), v.float(), scale)
    flash = ref.causal_attention(q, k, v, scale)  # torch's kernel, what bf16 ran before
    # Probabilities rounded to bf16 before their product with V, as torch's flash kernel
    # rounds them, and the output rounded once: within what torch's own kernel differs by.
    tolerance = max(float((flash.float() - exact).abs().max()), 0.0) * 1.5 + 1e-3
    assert float((got.float() - exact).abs().max()) <= tolerance
    torch.testing.assert_close(got.float(), exact, rtol=2**-6, atol=2e-2)
    # Row 0 sees only itself: its output is its own value row, rounded.
    own = v[0].repeat_interleave(heads // kv_heads, dim=0)
    torch.testing.assert_close(got[0].float(), own.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("tiles", VARIANTS)
def test_a_later_key_changes_only_the_rows_after_it(tiles: bool) -> None:
    q, k, v = _qkv(50, 9, 3, 64, seed=1)
    before = cpu_attention.causal_attention(q, k, v, 0.125, tiles=tiles)
    k[40] += 3.0  # key 40: seen by queries 40.. only
    v[40] -= 2.0
    after = cpu_attention.causal_attention(q, k, v, 0.125, tiles=tiles)
    assert torch.equal(after[:40], before[:40])
    assert not torch.equal(after[40:], before[40:])


@pytest.mark.skipif(not cpu_attention.uses_tiles(), reason="no AMX on this CPU")
def test_both_variants_agree_to_the_rounding_of_their_sums() -> None:
    q, k, v = _qkv(345, 9, 3, 64, seed=2)
    dot = cpu_attention.causal_attention(q, k, v, 0.125, tiles=False)
    tiles = cpu_attention.causal_attention(q, k, v, 0.125, tiles=True)
    torch.testing.assert_close(dot.float(), tiles.float(), rtol=2**-6, atol=1e-2)


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths cpu_attention.causal_attention is called with from now on."""
    calls: list[int] = []
    real = cpu_attention.causal_attention

    def counting(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention, "causal_attention", counting)
    return calls


def test_fresh_bf16_prompts_take_the_kernel_where_there_is_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.models.attention import (
        AttentionMetadata,
        LayerKVCache,
        PrefillSequence,
        paged_attention,
    )

    calls = _count_calls(monkeypatch)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _qkv(20, 9, 3, 64, seed=4)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        cache = LayerKVCache(key=torch.zeros(4, 16, 3, 64, dtype=dtype),
                             value=torch.zeros(4, 16, 3, 64, dtype=dtype))
        meta = AttentionMetadata(
            slot_mapping=torch.arange(20), num_decode_tokens=0, decode_block_tables=None,
            decode_context_lens=None,
            prefills=[PrefillSequence(query_start=0, query_len=20, context_len=20,
                                      block_ids=torch.tensor([0, 1]))],
        )
        assert meta.prefills[0].mask is None  # nothing cached before it
        out = paged_attention(q, k, v, cache, meta, 0.125)
        want = ref.causal_attention(q, k, v, 0.125)
        if dtype == torch.float32:
            assert torch.equal(out, want)  # the oracle's own call, bit for bit
        else:
            torch.testing.assert_close(out.float(), want.float(), rtol=2**-6, atol=2e-2)
    assert calls == ([20] if cpu_attention.available() else [])


@pytest.mark.skipif(not cpu_attention.available(), reason="no AVX-512 BF16 on this CPU")
def test_the_switch_turns_the_kernel_off() -> None:
    before = cpu_build.current_settings()
    try:
        cpu_build.configure(EngineConfig(cpu_prefill_kernel=False).kernel_settings)
        assert not cpu_attention.available() and not cpu_attention.uses_tiles()
        cpu_build.configure(EngineConfig(cpu_amx=False).kernel_settings)
        # AMX off: the dot-product variant still runs
        assert cpu_attention.available() and not cpu_attention.uses_tiles()
    finally:
        cpu_build.configure(before)
    assert cpu_attention.available()


def test_the_switch_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig().kernel_settings.prefill_attention is True
    monkeypatch.setenv("LORAPLEX_CPU_PREFILL_KERNEL", "0")
    assert EngineConfig().kernel_settings.prefill_attention is False
    assert cpu_build.settings_from_env().prefill_attention is False
