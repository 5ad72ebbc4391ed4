"""The weight-only quantized linear kernel (loraplex_kernels/cpu_quant.py) against a dense
matmul over the weights it stands for, and the layout's refusals."""

from __future__ import annotations

import pytest
import torch

from loraplex_kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")

SCHEMES = [(8, None), (8, 32), (4, 32), (4, 64)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize(("bits", "group"), SCHEMES)
def test_round_trip_error_is_at_most_half_a_step(bits: int, group: int | None) -> None:
    w = _weight(48, 192, 0)
    qw = cpu_quant.quantize(w, bits, group)
    deq = cpu_quant.dequantize(qw)
    # The kernel's dequantization and the layout's torch definition agree.
    torch.testing.assert_close(deq, cpu_quant.dequantize_reference(qw), rtol=0, atol=1e-7)
    g = group or 192
    step = (qw.scales.transpose(1, 2).reshape(48, 192 // g)
            .repeat_interleave(g, dim=1))
    assert bool(((deq - w).abs() <= step / 2 + 1e-7).all())
    assert qw.nbytes < w.numel() * 4 * (0.3 if bits == 4 else 0.3 + 8 / g)


# (4, 128): one group over all 128 inputs, with offsets.
@pytest.mark.parametrize(("bits", "group"), [*SCHEMES, (4, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 30, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_a_dense_matmul_over_the_dequantized_weights(
    bits: int, group: int | None, rows: int, dtype: torch.dtype
) -> None:
    w = _weight(80, 128, 1)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(2))
    qw = cpu_quant.quantize(w, bits, group)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = cpu_quant.linear(x, qw, bias)
    assert y.dtype == dtype and y.shape == (rows, 80)
    ref = torch.nn.functional.linear(x.float(), cpu_quant.dequantize(qw), bias)
    # float32: the same sum with each group's products scaled once instead of each
    # weight rounded after scaling: a few float32 ulps of the row's magnitude. bf16: the
    # output rounded once (half an ulp, 2^-9 relative).
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("inputs", [576, 320])
@pytest.mark.parametrize("rows", [12, 33])
def test_chunks_of_several_groups_give_each_input_its_groups_scale(
    bits: int, group: int, inputs: int, rows: int
) -> None:
    """Float32 rows of many rows on AVX2 run chunks of several whole groups with each
    weight scaled as it is converted (576 inputs in groups of 32: chunks of 96, three
    groups; 320: chunks of 64, two groups of 32 or one of 64)."""
    w = _weight(48, inputs, 6)
    qw = cpu_quant.quantize(w, bits, group)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(7))
    ref = torch.nn.functional.linear(x, cpu_quant.dequantize(qw))
    torch.testing.assert_close(cpu_quant.linear(x, qw), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_longer_than_the_kernels_chunk_is_summed_across_chunks(
    dtype: torch.dtype,
) -> None:
    """int8 per channel over 4,224 inputs: one group longer than any chunk the kernel
    converts at once (4,096 on the bf16 dot-product tiles, 128 on the float32 ones), so its
    sums carry across chunks before the group's scale."""
    w = _weight(48, 4224, 4)
    qw = cpu_quant.quantize(w, 8, None)
    assert qw.group_size == 4224
    x = torch.randn(13, 4224, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = cpu_quant.linear(x, qw)
    ref = torch.nn.functional.linear(x.float(), cpu_quant.dequantize(qw))
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=2e-3)


def test_linear_writes_strided_output_rows_and_takes_strided_input_rows() -> None:
    qw = cpu_quant.quantize(_weight(32, 64, 3), 4, 32)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows of stride 100
    out = torch.full((5, 48), 7.0)
    y = cpu_quant.linear(x, qw, out=out[:, 8:40])
    torch.testing.assert_close(y, torch.nn.functional.linear(x, cpu_quant.dequantize(qw)),
                               rtol=1e-5, atol=1e-5)
    assert bool((out[:, :8] == 7).all()) and bool((out[:, 40:] == 7).all())


def test_int4_values_and_offsets_are_laid_out_as_documented() -> None:
    # q[n][k] = (n + k) % 16, scale 1 + n, offset -n: w[n][k] = q (1 + n) - n.
    n, k, g = 16, 8, 4
    q = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    scales = (1.0 + torch.arange(n, dtype=torch.float32))[:, None].expand(n, k // g)
    offsets = -torch.arange(n, dtype=torch.float32)[:, None].expand(n, k // g)
    qw = cpu_quant.pack(q, scales, offsets, 4, g)
    # Block 0, input pair 0: column c holds q[c][0] low and q[c][1] high.
    first = qw.qweight[:16]
    assert first.tolist() == [(c % 16) | (((c + 1) % 16) << 4) for c in range(16)]
    expected = q.float() * scales.repeat_interleave(g, 1) + offsets.repeat_interleave(g, 1)
    torch.testing.assert_close(cpu_quant.dequantize(qw), expected, rtol=0, atol=0)
    torch.testing.assert_close(cpu_quant.dequantize_reference(qw), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"out_features": 40}, "output features"),
        ({"group_size": 48}, "group size 48"),
        ({"bits": 3}, "3 bits"),
        ({"scales": torch.zeros(2, 3, 16)}, "scales"),
        ({"qweight": torch.zeros(10, dtype=torch.uint8)}, "packed weights"),
    ],
)
def test_a_mismatched_quantized_weight_is_refused_in_one_line(change: dict, message: str) -> None:
    qw = cpu_quant.quantize(_weight(32, 64, 4), 4, 32)
    fields = {f: getattr(qw, f) for f in ("qweight", "scales", "offsets", "bits", "group_size",
                                          "out_features", "in_features")}
    with pytest.raises(ValueError, match=message) as err:
        cpu_quant.QuantizedWeight(**{**fields, **change})
    assert "\n" not in str(err.value)


def test_quantize_refuses_a_group_that_does_not_divide_the_inputs() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        cpu_quant.quantize(_weight(16, 60, 5), 4, 32)
