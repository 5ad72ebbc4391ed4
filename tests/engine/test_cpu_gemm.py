"""The bf16 linear kernel (loraplex_kernels/cpu_gemm.py) against F.linear. The AMX variant: the
same float32 sums rounded once, bit for bit, for every row count it takes, with and without
bias, on strided rows; oneDNN's own AMX matmuls still right after it ran on the same threads.
The dot-product variant (AVX-512 BF16): within float32 summation error of the exact product,
for any row count. Both: the shapes they refuse, the fused SiLU equal to the linear and then
silu_mul bit for bit, PackedLinear choosing them (AMX: steps of up to 32 rows, oneDNN for the
rest; without AMX: every step, no oneDNN copy) and the switches."""

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
    kernel_weight_bytes,
    pack_linears,
    packing_available,
)
from engine.models.llama import LlamaMLP
from loraplex_kernels import cpu_build, cpu_gemm, cpu_ops
from loraplex_kernels import reference as ref

needs_amx = pytest.mark.skipif(not cpu_gemm.uses_tiles(), reason="no AMX on this CPU")
needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no AVX-512 BF16 on this CPU")
# The variants to run here: tiles=True (AMX) where granted, tiles=False (dot product) where
# the CPU has AVX-512 BF16.
VARIANTS = [pytest.param(True, marks=needs_amx, id="tiles"),
            pytest.param(False, marks=needs_kernel, id="dot_product")]


def _case(rows: int, out_features: int, in_features: int, seed: int = 0,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = (torch.randn(rows, in_features + 24, generator=gen) * 2).bfloat16()[:, 24:]
    return weight, bias, x


def _count_rows(monkeypatch: pytest.MonkeyPatch, kernel: str) -> list[int]:
    """The row counts cpu_gemm's `kernel` is called with from now on."""
    calls: list[int] = []
    real = getattr(cpu_gemm, kernel)

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cpu_gemm, kernel, counting)
    return calls


def test_pack_weight_lays_out_16_columns_by_32_inputs_a_tile() -> None:
    n, k = 64, 96
    cols = torch.arange(n).view(n, 1).expand(n, k).bfloat16()
    ins = torch.arange(k).view(1, k).expand(n, k).bfloat16()
    pc, pi = cpu_gemm.pack_weight(cols.contiguous()), cpu_gemm.pack_weight(ins.contiguous())
    assert pc.numel() == n * k and pc.is_contiguous()
    tile = 1024 // 2  # bf16 values a tile
    flat_c, flat_i = pc.flatten().long(), pi.flatten().long()
    # Tile (column block 2, input block 1), its row 5 (inputs 32 + 10, 32 + 11), column 7.
    at = (2 * (k // 32) + 1) * tile + 5 * 32 + 7 * 2
    assert flat_c[at].item() == 2 * 16 + 7 and flat_i[at].item() == 32 + 10
    assert flat_c[at + 1].item() == 2 * 16 + 7 and flat_i[at + 1].item() == 32 + 11
    # And back.
    weight = torch.randn(n, k).bfloat16()
    assert torch.equal(cpu_gemm.unpack_weight(cpu_gemm.pack_weight(weight), n), weight)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_f_linear_bit_for_bit(rows: int, with_bias: bool) -> None:
    weight, bias, x = _case(rows, 96, 160)
    b = bias if with_bias else None
    got = cpu_gemm.linear(x, cpu_gemm.pack_weight(weight), 96, b, tiles=True)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16 and got.is_contiguous()
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8 + 1e-5, atol=1e-3)
    # oneDNN sums in float32 and rounds once too: the same bits.
    assert torch.equal(got, F.linear(x, weight, b))


def _exact_and_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 and how far a float32 sum of it, rounded once to bf16, may be
    from it: half a bf16 ulp of the value, plus K float32 roundings of the partial sums'
    magnitudes (sum of |x w|), bounded by K * 2^-24 * sum |x w|."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs(),
                         None if bias is None else bias.double().abs())
    k = x.shape[1]
    return exact, exact.abs() * 2**-8 + magnitude * (k + 1) * 2**-24 + 1e-30


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dot_product_linear_is_the_product_rounded_once(rows: int, with_bias: bool) -> None:
    """The dot-product variant sums in float32 in input order and rounds once: within that
    error of the exact product, for any row count (the 4-row blocks and every tail), and
    column counts whose blocks do not divide by 3 (96: 3 pairs; 160: 5; 64: 2)."""
    for out_features in (96, 160, 64):
        weight, bias, x = _case(rows, out_features, 160)
        b = bias[:out_features] if with_bias else None
        got = cpu_gemm.linear(x, cpu_gemm.pack_weight(weight), out_features, b, tiles=False)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        exact, bound = _exact_and_bound(x, weight, b)
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), (out_features, (err - bound).max().item())
        # oneDNN's bf16 matmul is the same arithmetic in another order: within one bf16
        # rounding of each other.
        torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(),
                                   rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("tiles", VARIANTS)
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (49152, 576)])
def test_linear_on_a_models_shapes(out_features: int, in_features: int, tiles: bool) -> None:
    weight, bias, x = _case(32, out_features, in_features, seed=3)
    got = cpu_gemm.linear(x, cpu_gemm.pack_weight(weight), out_features, bias, tiles=tiles)
    if tiles:
        assert torch.equal(got, F.linear(x, weight, bias))
    else:
        exact, bound = _exact_and_bound(x, weight, bias)
        assert ((got.double() - exact).abs() <= bound).all()


@needs_kernel
def test_linear_refuses_what_it_does_not_take() -> None:
    weight, _, x = _case(33, 64, 64)
    packed = cpu_gemm.pack_weight(weight)
    with pytest.raises(AssertionError):
        cpu_gemm.linear(x, packed, 64, tiles=True)  # 33 rows: never on tiles
    with pytest.raises(AssertionError):
        cpu_gemm.linear(x[:4].float(), packed, 64)
    with pytest.raises(AssertionError):
        cpu_gemm.linear(x[:4], packed, 32)  # the packed weight is not [32, 64]
    with pytest.raises(AssertionError):
        cpu_gemm.linear_silu_mul(x[:4], cpu_gemm.pack_weight(weight[:32]), 32)  # odd halves
    assert not cpu_gemm.fits(48, 64) and not cpu_gemm.fits(64, 40) and cpu_gemm.fits(64, 64)
    with pytest.raises(AssertionError):
        cpu_gemm.pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    # 33 rows are the dot-product variant's to take (the default where there is no AMX).
    assert cpu_gemm.linear(x, packed, 64, tiles=False).shape == (33, 64)


@needs_amx
def test_onednn_amx_matmuls_stay_right_after_the_kernel_ran() -> None:
    """The kernel leaves the tiles released; oneDNN's packed bf16 matmuls (AMX here) that
    run on the same threads afterwards still give their own results."""
    weight, bias, _ = _case(1, 256, 576, seed=7)
    layer = PackedLinear(weight, bias)
    assert layer.kernel_weight is not None and layer.kernel_role == "tiles"
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
        if layer.kernel_role == "every_step":  # another order of the same float32 sums
            torch.testing.assert_close(layer(x).float(), F.linear(x, weight, bias).float(),
                                       rtol=2**-7, atol=1e-2)
        else:
            assert torch.equal(layer(x), F.linear(x, weight, bias)), rows
    if cpu_gemm.uses_tiles():  # AMX: the tiles for up to 32 rows, and oneDNN's copy too
        assert layer.kernel_role == "tiles" and layer.packed_weight is not None
        assert calls == [1, 32] and kernel_weight_bytes(layer, "tiles") == 64 * 96 * 2
    elif cpu_gemm.available():  # AVX-512 BF16 alone: the kernel for every step, one copy
        assert layer.kernel_role == "every_step" and layer.packed_weight is None
        assert calls == [1, 32, 33, 300] and kernel_weight_bytes(layer, "tiles") == 0
        assert kernel_weight_bytes(layer) == 64 * 96 * 2
    else:  # oneDNN for every step
        assert calls == [] and layer.kernel_weight is None and kernel_weight_bytes(layer) == 0
    # float32 layers never get the kernel's layout.
    assert PackedLinear(weight.float(), None).kernel_weight is None


@pytest.mark.parametrize("tiles", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 32, 45])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_silu_mul_is_the_linear_then_silu_mul_bit_for_bit(
    rows: int, with_bias: bool, tiles: bool,
) -> None:
    if tiles and rows > cpu_gemm.MAX_TILE_ROWS:
        pytest.skip("the AMX variant takes at most 32 rows")
    weight, bias, x = _case(rows, 192, 160, seed=11)
    weight = weight * 0.2  # gates over SiLU's whole range, not only its tails
    x[0, :3] = torch.tensor([float("nan"), 1e30, -1e30]).bfloat16()  # NaN and overflows
    b = bias if with_bias else None
    packed = cpu_gemm.pack_weight(weight)
    got = cpu_gemm.linear_silu_mul(x, packed, 192, b, tiles=tiles)
    want = cpu_ops.silu_mul(cpu_gemm.linear(x, packed, 192, b, tiles=tiles))
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


@needs_kernel
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
def test_the_amx_switch_turns_the_tiles_off() -> None:
    """cpu_amx False on an AMX CPU: oneDNN (its own AMX matmuls) for every step, no second
    copy, and no tiles for prompt attention either."""
    from loraplex_kernels import cpu_attention

    before = cpu_build.current_settings()
    try:
        cpu_build.configure(EngineConfig(cpu_amx=False).kernel_settings)
        assert not cpu_gemm.uses_tiles() and cpu_gemm.role() is None
        assert not cpu_attention.uses_tiles()
        weight, bias, x = _case(4, 64, 96)
        layer = PackedLinear(weight, bias)
        assert layer.kernel_weight is None  # no second copy either
        assert torch.equal(layer(x), F.linear(x, weight, bias))
    finally:
        cpu_build.configure(before)
    assert cpu_gemm.uses_tiles()


@needs_kernel
def test_the_gemm_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_gemm False: oneDNN for every bf16 layer; and a layer built while the kernel was
    on, whose weights are in the kernel's layout alone, still answers when it is switched
    off afterwards (its weights unpacked for F.linear)."""
    before = cpu_build.current_settings()
    weight, bias, x = _case(40, 64, 96)
    built_on = PackedLinear(weight, bias)
    assert built_on.kernel_weight is not None
    try:
        cpu_build.configure(EngineConfig(cpu_gemm=False).kernel_settings)
        assert not cpu_gemm.available() and cpu_gemm.role() is None
        calls = _count_rows(monkeypatch, "linear")
        layer = PackedLinear(weight, bias)
        assert layer.kernel_weight is None and layer.packed_weight is not None
        assert torch.equal(layer(x), F.linear(x, weight, bias))
        assert torch.equal(built_on(x), F.linear(x, weight, bias))
        assert built_on.silu_mul(x) is None
        assert calls == []
    finally:
        cpu_build.configure(before)
    assert cpu_gemm.available()


def test_the_switches_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, attr in (("LORAPLEX_CPU_AMX", "amx"), ("LORAPLEX_CPU_GEMM", "gemm")):
        monkeypatch.delenv(name, raising=False)
        assert getattr(EngineConfig().kernel_settings, attr) is True
        monkeypatch.setenv(name, "0")
        assert getattr(EngineConfig().kernel_settings, attr) is False
        assert getattr(cpu_build.settings_from_env(), attr) is False
