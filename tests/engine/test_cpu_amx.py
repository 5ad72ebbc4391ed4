"""The AMX linear kernel (loraplex_kernels/cpu_amx.py) against F.linear: the same float32
sums rounded once, for every row count it takes, with and without bias, on strided rows;
the shapes it refuses; PackedLinear choosing it for steps of up to 32 rows and oneDNN for
the rest; and oneDNN's own AMX matmuls still right after it ran on the same threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.lora.layers import LoRAGroup
from engine.lora.weights import LoRAModule
from engine.models.config import ModelConfig
from engine.models.cpu_linear import (
    PackedLinear,
    amx_weight_bytes,
    pack_linears,
    packing_available,
)
from engine.models.llama import LlamaMLP
from loraplex_kernels import cpu_amx, cpu_build, cpu_ops
from loraplex_kernels import reference as ref

needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason="no AMX on this CPU")


def _case(rows: int, out_features: int, in_features: int, seed: int = 0,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = (torch.randn(rows, in_features + 24, generator=gen) * 2).bfloat16()[:, 24:]
    return weight, bias, x


def _count_rows(monkeypatch: pytest.MonkeyPatch, kernel: str) -> list[int]:
    """The row counts cpu_amx's `kernel` is called with from now on."""
    calls: list[int] = []
    real = getattr(cpu_amx, kernel)

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_amx, kernel, counting)
    return calls


def test_pack_weight_lays_out_16_columns_by_32_inputs_a_tile() -> None:
    n, k = 64, 96
    cols = torch.arange(n).view(n, 1).expand(n, k).bfloat16()
    ins = torch.arange(k).view(1, k).expand(n, k).bfloat16()
    pc, pi = cpu_amx.pack_weight(cols.contiguous()), cpu_amx.pack_weight(ins.contiguous())
    assert pc.numel() == n * k and pc.is_contiguous()
    tile = 1024 // 2  # bf16 values a tile
    flat_c, flat_i = pc.flatten().long(), pi.flatten().long()
    # Tile (column block 2, input block 1), its row 5 (inputs 32 + 10, 32 + 11), column 7.
    at = (2 * (k // 32) + 1) * tile + 5 * 32 + 7 * 2
    assert flat_c[at].item() == 2 * 16 + 7 and flat_i[at].item() == 32 + 10
    assert flat_c[at + 1].item() == 2 * 16 + 7 and flat_i[at + 1].item() == 32 + 11


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_f_linear_bit_for_bit(rows: int, with_bias: bool) -> None:
    weight, bias, x = _case(rows, 96, 160)
    b = bias if with_bias else None
    got = cpu_amx.linear(x, cpu_amx.pack_weight(weight), 96, b)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16 and got.is_contiguous()
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8 + 1e-5, atol=1e-3)
    # oneDNN sums in float32 and rounds once too: the same bits.
    assert torch.equal(got, F.linear(x, weight, b))


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (49152, 576)])
def test_amx_linear_on_a_models_shapes(out_features: int, in_features: int) -> None:
    weight, bias, x = _case(32, out_features, in_features, seed=3)
    got = cpu_amx.linear(x, cpu_amx.pack_weight(weight), out_features, bias)
    assert torch.equal(got, F.linear(x, weight, bias))


@needs_amx
def test_amx_linear_refuses_what_it_does_not_take() -> None:
    weight, _, x = _case(33, 64, 64)
    packed = cpu_amx.pack_weight(weight)
    with pytest.raises(AssertionError):
        cpu_amx.linear(x, packed, 64)  # 33 rows
    with pytest.raises(AssertionError):
        cpu_amx.linear(x[:4].float(), packed, 64)
    assert not cpu_amx.fits(48, 64) and not cpu_amx.fits(64, 40) and cpu_amx.fits(64, 64)
    with pytest.raises(AssertionError):
        cpu_amx.pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))


@needs_amx
def test_onednn_amx_matmuls_stay_right_after_the_kernel_ran() -> None:
    """The kernel leaves the tiles released; oneDNN's packed bf16 matmuls (AMX here) that
    run on the same threads afterwards still give their own results."""
    weight, bias, _ = _case(1, 256, 576, seed=7)
    layer = PackedLinear(weight, bias)
    assert layer.amx_weight is not None
    gen = torch.Generator().manual_seed(11)
    for rows in (3, 200, 32, 700, 17, 64):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        assert torch.equal(layer(x), F.linear(x, weight, bias)), rows


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bf16 linear kernels for this CPU")
def test_packed_linear_takes_the_kernel_for_few_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight, bias, _ = _case(1, 64, 96, seed=5)
    calls = _count_rows(monkeypatch, "linear")
    layer = PackedLinear(weight, bias)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 32, 33, 300):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        assert torch.equal(layer(x), F.linear(x, weight, bias)), rows
    if cpu_amx.available():
        assert calls == [1, 32] and amx_weight_bytes(layer) == 64 * 96 * 2
    else:  # no AMX here: oneDNN for every step, and no second copy
        assert calls == [] and layer.amx_weight is None and amx_weight_bytes(layer) == 0
    # float32 layers never get the copy.
    assert PackedLinear(weight.float(), None).amx_weight is None


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_silu_mul_is_the_linear_then_silu_mul_bit_for_bit(
    rows: int, with_bias: bool,
) -> None:
    weight, bias, x = _case(rows, 192, 160, seed=11)
    weight = weight * 0.2  # gates over SiLU's whole range, not only its tails
    x[0, :3] = torch.tensor([float("nan"), 1e30, -1e30]).bfloat16()  # NaN and overflows
    b = bias if with_bias else None
    packed = cpu_amx.pack_weight(weight)
    got = cpu_amx.linear_silu_mul(x, packed, 192, b)
    want = cpu_ops.silu_mul(cpu_amx.linear(x, packed, 192, b))
    assert got.shape == (rows, 96) and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0].isnan().any() and not got[1:].isnan().any()
    # And the formula itself (Hugging Face's): silu(gate) rounded, times up.
    gate_up = F.linear(x[1:], weight, b)
    hf = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    torch.testing.assert_close(got[1:].float(), hf.float(), rtol=2**-7, atol=1e-30)


def _mlp(lora_targets: tuple[bool, bool]) -> tuple[LlamaMLP, ref.LoRASegments]:
    """A packed bf16 MLP (hidden 64, intermediate 96) with LoRA slot 0 holding an adapter
    of gate_up (if lora_targets[0]) and of down (if [1]); rows 0 and 2 on the slot."""
    config = ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=1e4, rope_scaling=None, qkv_bias=False, o_bias=False, mlp_bias=False,
        tie_word_embeddings=True, max_position_embeddings=64, eos_token_ids=[0],
        bos_token_id=None, sliding_window=None, max_model_len=64,
    )
    gen = torch.Generator().manual_seed(4)
    mlp = LlamaMLP(config, torch.bfloat16).to_empty(device="cpu")
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pack_linears(mlp)
    lora = {name: LoRAGroup(1, 8, fin, sizes, device=torch.device("cpu"), dtype=torch.bfloat16)
            for name, fin, sizes in (("gate_up", 64, (96, 96)), ("down", 96, (64,)))}

    def module(fin: int, fout: int) -> LoRAModule:
        return LoRAModule((torch.randn(8, fin, generator=gen) * 0.3).bfloat16(),
                          (torch.randn(fout, 8, generator=gen) * 0.3).bfloat16(), 2.0)

    if lora_targets[0]:
        lora["gate_up"].set_slot(0, [module(64, 96), module(64, 96)])
    if lora_targets[1]:
        lora["down"].set_slot(0, [module(96, 64)])
    mlp.gate_up_lora, mlp.down_lora = lora["gate_up"], lora["down"]
    segs = ref.LoRASegments.from_token_slots([0, -1, 0, -1])
    assert segs is not None
    return mlp, segs


@needs_amx
@pytest.mark.parametrize("gate_up_adapted", [False, True])
def test_the_mlp_runs_the_silu_in_the_matmul_unless_an_adapter_adapts_gate_up(
    monkeypatch: pytest.MonkeyPatch, gate_up_adapted: bool,
) -> None:
    mlp, segs = _mlp((gate_up_adapted, True))
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    # Unfused (the layer declines): its matmul, the adapters' deltas, the SiLU, then down.
    monkeypatch.setattr(PackedLinear, "silu_mul", lambda self, x: None)
    want = mlp(x, segs)
    want_base = mlp(x, None)
    monkeypatch.undo()
    fused = _count_rows(monkeypatch, "linear_silu_mul")
    assert torch.equal(mlp(x, segs), want)
    assert torch.equal(mlp(x, None), want_base)
    # Without adapters, or with one that leaves gate_up alone: fused (the down adapter
    # still applies); with a gate_up adapter its delta comes before the SiLU: not fused.
    assert fused == ([4] if gate_up_adapted else [4, 4])
    assert not torch.equal(want, want_base)


@needs_amx
def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_build.current_settings()
    try:
        cpu_build.configure(EngineConfig(cpu_amx=False).kernel_settings)
        assert not cpu_amx.available()
        weight, bias, x = _case(4, 64, 96)
        layer = PackedLinear(weight, bias)
        assert layer.amx_weight is None  # no second copy either
        assert torch.equal(layer(x), F.linear(x, weight, bias))
    finally:
        cpu_build.configure(before)
    assert cpu_amx.available()


def test_the_switch_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_CPU_AMX", raising=False)
    assert EngineConfig().kernel_settings.amx is True
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "0")
    assert EngineConfig().kernel_settings.amx is False
