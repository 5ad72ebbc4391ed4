"""The CUDA layouts of quantized weights (loraplex_kernels/device_quant.py) in torch on
the CPU: the same values as the CPU layouts for the same integers, fp8 linear layers
against their definition, QuantLinear and the loader's packing for a GPU, and which
device serves which scheme. The Triton kernel itself: tests/gpu/test_quant_kernels.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from engine.config import QuantizationSpec
from engine.models.quantized import QuantizedRows, QuantLinear, quantize_linears, quantize_rows
from loraplex_kernels import cpu_quant, device_quant


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, 64)],
                         ids=lambda v: str(v))
def test_same_integers_same_weight_as_the_cpu_layout(bits: int, group: int | None) -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits))
    q, scales, offsets, g = cpu_quant.quantize_integers(w, bits, group)
    on_gpu = device_quant.pack(q, scales, offsets, bits, g, "cpu")
    on_cpu = cpu_quant.pack(q, scales, offsets, bits, g)
    assert torch.equal(device_quant.unpack_integers(on_gpu).to(q.dtype), q)
    assert torch.equal(device_quant.dequantize(on_gpu), cpu_quant.dequantize_reference(on_cpu))
    assert on_gpu.nbytes == on_cpu.nbytes
    assert on_gpu.nbytes == 48 * 128 * bits // 8 + scales.numel() * 4 * (2 if bits == 4 else 1)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)], ids=lambda v: str(v))
def test_dequantize_in_blocks_of_rows_is_the_same(bits: int, group: int | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(9))
    q, scales, offsets, g = cpu_quant.quantize_integers(w, bits, group)
    qw = device_quant.pack(q, scales, offsets, bits, g, "cpu")
    fp8 = device_quant.pack_fp8(*device_quant.quantize_fp8(w), "cpu")
    whole = device_quant.dequantize(qw, torch.bfloat16), device_quant.dequantize(fp8)
    monkeypatch.setattr(device_quant, "DEQUANTIZE_ELEMENTS", 7 * 64)  # 7 rows, then 6
    assert torch.equal(device_quant.dequantize(qw, torch.bfloat16), whole[0])
    assert torch.equal(device_quant.dequantize(fp8), whole[1])
    want = cpu_quant.dequantize_reference(cpu_quant.pack(q, scales, offsets, bits, g))
    assert torch.equal(whole[0], want.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_path_is_the_product_with_the_dequantized_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=gen)
    qw = device_quant.pack(*cpu_quant.quantize_integers(w, 4, 32)[:3], 4, 32, "cpu")
    x = torch.randn(9, 96, generator=gen).to(dtype)
    bias = torch.randn(64, generator=gen)
    got = device_quant.linear(x, qw, bias)
    want = (x.float() @ device_quant.dequantize(qw, dtype).float().t() + bias)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    assert got.dtype == dtype and torch.allclose(got.float(), want, atol=tol, rtol=tol)


def test_pack_refuses_what_it_cannot_hold() -> None:
    q = torch.zeros(16, 32, dtype=torch.int8)
    s = torch.ones(16, 1)
    with pytest.raises(ValueError, match=r"int4 values outside 0\.\.15"):
        device_quant.pack(q - 1, s, None, 4, 32, "cpu")
    with pytest.raises(ValueError, match="group size 24 for 32 input features"):
        device_quant.pack(q, torch.ones(16, 2), None, 8, 24, "cpu")
    with pytest.raises(ValueError, match=r"scales \(16, 3\)"):
        device_quant.pack(q, torch.ones(16, 3), None, 8, 16, "cpu")
    with pytest.raises(ValueError, match="multiples of 16"):
        device_quant.pack_fp8(*device_quant.quantize_fp8(torch.randn(16, 40)), "cpu")
    with pytest.raises(ValueError, match=r"must be torch\.float8_e4m3fn"):
        device_quant.pack_fp8(q, s, "cpu")


def test_fp8_weights_round_to_three_mantissa_bits_per_channel() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    w[5] = 0.0  # a row of zeros keeps its zeros (scale 1)
    w[7] *= 1e4  # channels are scaled apart
    qw = device_quant.pack_fp8(*device_quant.quantize_fp8(w), "cpu")
    back = device_quant.dequantize(qw)
    assert torch.equal(back[5], torch.zeros(64))
    rowmax = w.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits (relative error <= 2^-4) down to its normal range, 2^-6 of
    # the channel's maximum / 448; below, a subnormal step of 2^-9 of that scale.
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2 ** -4 + rowmax / 448 * 2 ** -9 + 1e-12).all())
    assert float(back.abs().amax(-1)[7]) == pytest.approx(float(rowmax[7]), rel=1e-6)


def test_fp8_linear_matches_its_definition_and_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(4)
    qw = device_quant.pack_fp8(*device_quant.quantize_fp8(torch.randn(48, 64, generator=gen)),
                               "cpu")
    bias = torch.randn(48, generator=gen)
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1, 10, 1e3, 1, 1])[:, None]
    x[4] = 0.0
    got = device_quant.linear(x, qw, bias)
    want = device_quant.reference_linear(x, qw, bias)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4], bias)  # a row of zeros: the bias alone
    # Each row's activation scale is its own: alone or beside others, the same bits.
    for t in range(6):
        assert torch.equal(device_quant.linear(x[t:t + 1], qw, bias)[0], got[t])
    # The activations are quantized: the product differs from the float one...
    exact = x.double() @ device_quant.dequantize(qw).double().t() + bias.double()
    assert not torch.allclose(got.double(), exact, rtol=1e-6, atol=1e-6)
    # ...by what fake_quantize_fp8 stands for, which a Hugging Face oracle's hook feeds.
    faked = device_quant.fake_quantize_fp8(x).double() @ device_quant.dequantize(qw).double().t()
    assert torch.allclose(got.double(), faked + bias.double(), rtol=1e-5, atol=1e-5)


def test_fp8_nan_and_inf_rows_stay_in_their_row() -> None:
    qw = device_quant.pack_fp8(*device_quant.quantize_fp8(torch.randn(16, 32)), "cpu")
    x = torch.randn(3, 32)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    y = device_quant.linear(x, qw)
    assert bool(torch.isfinite(y[0]).all())
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isnan(y[2]).all())


def test_quant_linear_runs_the_device_layouts() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 64, generator=gen)
    bias = torch.randn(32, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    rows = quantize_rows(w, QuantizationSpec("int8"))
    layer = QuantLinear(rows.pack(device="cpu"), bias)  # the CPU's layout
    moved = QuantLinear(device_quant.pack(rows.q, rows.scales, None, 8, 64, "cpu"), bias)
    assert moved(x).shape == (2, 3, 32)
    assert torch.allclose(moved(x), layer(x), atol=1e-5)
    fp8 = quantize_rows(w, QuantizationSpec("fp8"))
    assert fp8.q.dtype == device_quant.FP8_DTYPE and fp8.group == 64
    fp8_layer = QuantLinear(device_quant.pack_fp8(fp8.q, fp8.scales, "cpu"), bias)
    assert "fp8" in fp8_layer.extra_repr()
    want = device_quant.reference_linear(x.reshape(-1, 64), fp8_layer.quantized, bias)
    assert torch.allclose(fp8_layer(x).reshape(-1, 32).double(), want, atol=1e-5)


def test_the_loader_packs_for_the_device() -> None:
    """QuantizedRows.pack and quantize_linears pick the layout by device (meta stands in
    for a GPU: nothing is computed there)."""
    w = torch.randn(32, 64)
    int4 = quantize_rows(w, QuantizationSpec("int4"))
    assert isinstance(int4.pack(device="meta"), device_quant.DeviceQuantizedWeight)
    assert isinstance(int4.pack(device="cpu"), cpu_quant.QuantizedWeight)
    fp8 = quantize_rows(w, QuantizationSpec("fp8"))
    # Row blocks of a fused layer stack as the integer ones do.
    fused = QuantizedRows.cat([fp8, fp8.map_rows(lambda t: t.flip(0))])
    packed = fused.pack(device="meta")
    assert isinstance(packed, device_quant.Fp8Weight) and packed.out_features == 64
    with pytest.raises(ValueError, match="fp8 weights run on CUDA"):
        fp8.pack(device="cpu")
    with pytest.raises(ValueError, match="w8a8 runs on the CPU"):
        quantize_rows(w, QuantizationSpec("int8")).pack(True, "meta")
    layers = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    assert quantize_linears(layers, QuantizationSpec("fp8"), "meta") == 2
    assert all(isinstance(m, QuantLinear) and isinstance(m.quantized, device_quant.Fp8Weight)
               for m in layers)


def test_which_device_serves_which_scheme() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    # int8 and int4 on both; w8a8 on the CPU only; fp8 on CUDA from compute capability 8.9.
    for scheme in ("none", "int8", "int4"):
        QuantizationSpec(scheme).check_device(cpu)
        QuantizationSpec(scheme).check_device(cuda)
    QuantizationSpec("w8a8").check_device(cpu)
    with pytest.raises(ValueError, match="w8a8 runs on the CPU; on cuda:0 use fp8"):
        QuantizationSpec("w8a8").check_device(cuda)
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        QuantizationSpec("fp8").check_device(cpu)
    # NOTE: no GPU here: the device's capability is what NVML / the driver would say.
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        QuantizationSpec("fp8").check_device(cuda)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 6)), \
            mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A10"), \
            pytest.raises(ValueError, match=r"NVIDIA A10 has 8\.6: use int8 or int4"):
        QuantizationSpec("fp8").check_device(cuda)
