"""The w8a8 linear kernel (loraplex_kernels/cpu_qdot.py): int8 weights per output channel,
activations quantized to int8 per row and group as it runs.

Against `reference_linear` (the same arithmetic in torch, float64 sums), and the build this
CPU runs (the VNNI tiles where it has AVX-512 VNNI) against the generic loops' build, bit
for bit: both sum the same integers exactly and take the same float32 steps."""

from __future__ import annotations

import pytest
import torch

from loraplex_kernels import cpu_qdot

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler here")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _rows(t: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes, and an outlier input, as a model's activations have.
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 1, t)[:, None]
    x[:, k // 3] *= 20
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


# (N, K): blocks of 16 columns in threes and left over (48: 3, 64: 3 + 1, 80: 3 + 2);
# inputs in groups of 64, 32, 16 and 4.
SHAPES = [(48, 128), (64, 96), (80, 576), (960, 576), (16, 48), (32, 36)]
# Every row tile (4, 2 and 1 rows) alone and after others, a decode step's 32, and more.
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 13, 32, 130]


@pytest.mark.parametrize(("n", "k", "group"),
                         [*((n, k, None) for n, k in SHAPES), (80, 576, 32), (64, 96, 16),
                          (48, 128, 32)])
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_reference_and_the_generic_build(
    n: int, k: int, group: int | None, rows: int, dtype: torch.dtype
) -> None:
    """Per-channel weights (group None) and grouped ones (a scale per group of the
    activations' inputs, as the output projection holds them)."""
    qw = cpu_qdot.quantize(_weight(n, k, n + k), group)
    assert qw.grouped == (group is not None)
    assert qw.act_group == (group if group is not None else cpu_qdot.act_group(k))
    # The integer sums are exact; the float32 steps (a group's sum times its scale, added
    # in order; times the channel's scale) round a few times: a few float32 ulps of the
    # row's magnitude. bf16: the output rounded once more (2^-9 relative).
    _check_against_reference_and_generic(qw, _rows(rows, k, rows, dtype), 1e-6)


def _check_against_reference_and_generic(qw: cpu_qdot.QDotWeight, x: torch.Tensor,
                                         f32_tol: float) -> None:
    """With and without a bias: the kernel's output has x's dtype and shape, the generic
    build's bits, and is within `f32_tol` of reference_linear relative to the row's
    largest output at float32 (2^-8 at bf16)."""
    rows, n = x.shape[0], qw.out_features
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for b in (None, bias):
        y = cpu_qdot.linear(x, qw, b)
        assert y.dtype == x.dtype and y.shape == (rows, n)
        assert _same(y, cpu_qdot.linear(x, qw, b, generic=True))
        ref = cpu_qdot.reference_linear(x.float(), qw, b)
        scale = ref.abs().amax(1, keepdim=True).clamp(min=1e-30)
        tol = f32_tol if x.dtype == torch.float32 else 2**-8
        assert float(((y.float() - ref) / scale).abs().max()) <= tol


def test_rows_past_the_row_chunk_strided_rows_and_none() -> None:
    """More rows than a chunk (128), read from rows of a wider tensor (a fused layer's
    slice) into an output of wider rows; and a step of no rows."""
    qw = cpu_qdot.quantize(_weight(96, 64, 9))
    x_wide = _rows(300, 200, 4, torch.float32)
    x = x_wide[:, 40:104]
    assert x.stride(0) == 200
    wide = torch.full((300, 160), 7.0)
    out = wide[:, 32:128]
    cpu_qdot.linear(x, qw, None, out)
    torch.testing.assert_close(out, cpu_qdot.reference_linear(x, qw), rtol=0, atol=1e-5)
    assert torch.equal(out, cpu_qdot.linear(x.contiguous(), qw))
    assert bool((wide[:, :32] == 7).all()) and bool((wide[:, 128:] == 7).all())
    assert cpu_qdot.linear(x[:0], qw).shape == (0, 96)


def test_without_the_kernel_a_float_matmul_stands_in() -> None:
    """No compiler, or the kernels switched off: the quantized rows times the dequantized
    weights in float32 (no float64 copies of the weights per call)."""
    from loraplex_kernels import cpu_build

    qw = cpu_qdot.quantize(_weight(48, 128, 15), 32)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(16))
    x = _rows(5, 128, 17, torch.bfloat16)
    before = cpu_build.current_settings()
    cpu_build.configure(cpu_build.KernelSettings(enabled=False))
    try:
        assert not cpu_qdot.available()
        y = cpu_qdot.linear(x, qw, bias)
    finally:
        cpu_build.configure(before)
    assert y.dtype == torch.bfloat16
    ref = cpu_qdot.reference_linear(x.float(), qw, bias)
    scale = ref.abs().amax(1, keepdim=True)
    assert float(((y.float() - ref) / scale).abs().max()) <= 2**-8


def test_activations_quantize_to_nearest_even_in_groups() -> None:
    """The activations' integers and scales: s = max |x| / 127 per group of 64, round half
    to even (the kernel's result follows them: a row of exact halves is the case where
    rounding half away from zero, or truncation, gives other integers)."""
    group = 64
    x = torch.zeros(2, 128)
    x[0, :group] = torch.arange(group) - 31.5  # halves: -31.5 .. 31.5 with max 31.5
    x[0, 0] = 127.0  # scale 1: each value is its own x / s
    x[1, group:] = 3.0
    q, s = cpu_qdot.quantize_activations(x, group)
    assert float(s[0, 0]) == 1.0 and float(s[1, 0]) == 0.0
    assert float(s[1, 1]) == float(torch.tensor(3.0) / 127)
    expected = torch.round(x[0, 1:group])  # torch.round: half to even
    assert torch.equal(q[0, 1:group], expected)
    assert float(q[0, 2]) == -30.0  # -29.5 -> -30 (even), not -29
    assert bool((q[1, :group] == 0).all()) and bool((q[1, group:] == 127).all())
    # Weights that read each input once, scale 1: the outputs are the integers times s.
    qw = cpu_qdot.pack(torch.eye(128, dtype=torch.int8), torch.ones(128))
    y = cpu_qdot.linear(x, qw)
    assert torch.equal(y[0, 1:group], (q[0, 1:group] * s[0, 0]).to(torch.float32))
    assert torch.equal(y[1], (q[1] * s[1].repeat_interleave(group)).float())


def test_a_row_of_zeros_gives_the_bias_and_a_non_finite_row_stays_its_own() -> None:
    qw = cpu_qdot.quantize(_weight(48, 128, 5))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(6))
    x = _rows(6, 128, 2, torch.float32)
    clean = cpu_qdot.linear(x, qw, bias)
    x[1] = 0.0
    x[3, 7] = float("nan")
    x[4, 100] = float("inf")
    y = cpu_qdot.linear(x, qw, bias)
    assert torch.equal(y[1], bias)
    assert bool(y[3].isnan().all()) and bool(y[4].isnan().all())
    for r in (0, 2, 5):
        assert torch.equal(y[r], clean[r])


def test_pack_holds_the_integers_and_refuses_what_it_cannot() -> None:
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (32, 40), generator=g, dtype=torch.int8)
    scales = torch.rand(32, generator=g) + 0.1
    qw = cpu_qdot.pack(q, scales)
    assert torch.equal(cpu_qdot.integers(qw), q.to(torch.int16))
    assert qw.nbytes == 32 * 40 + 32 * 4 and qw.act_group == 8
    torch.testing.assert_close(cpu_qdot.dequantize(qw), q.float() * scales[:, None])
    with pytest.raises(ValueError, match="40 output features"):
        cpu_qdot.pack(torch.zeros(40, 8, dtype=torch.int8), torch.ones(40))
    with pytest.raises(ValueError, match="a multiple of 4"):
        cpu_qdot.pack(q[:, :38], scales)
    with pytest.raises(ValueError, match=r"outside -127\.\.127"):
        cpu_qdot.pack(torch.full((16, 8), -128, dtype=torch.int8), torch.ones(16))
    with pytest.raises(ValueError, match="31 scales"):
        cpu_qdot.pack(q, scales[:31])


def test_quantize_rounds_per_channel_within_half_a_step() -> None:
    w = _weight(64, 96, 11)
    qw = cpu_qdot.quantize(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool(((cpu_qdot.dequantize(qw) - w).abs() <= step / 2 + 1e-7).all())


def test_grouped_weights_are_the_weight_only_kernels_int8_groups() -> None:
    """In groups, the same integers and scales as cpu_quant's int8 (the embeddings' Q8_0
    grid), so the output projection and the embedding lookup stand for the same values."""
    from loraplex_kernels import cpu_quant

    w = _weight(64, 96, 14)
    qw = cpu_qdot.quantize(w, 32)
    assert torch.equal(cpu_qdot.dequantize(qw), cpu_quant.dequantize_reference(
        cpu_quant.quantize(w, 8, 32)))
    assert qw.group_size == 32 and qw.scale_rows().shape == (64, 3)
    with pytest.raises(ValueError, match="groups of 6 for 96 input features"):
        cpu_qdot.pack(torch.zeros(16, 96, dtype=torch.int8), torch.ones(16, 16), 6)
    with pytest.raises(ValueError, match="at most 1024"):
        cpu_qdot.pack(torch.zeros(16, 4096, dtype=torch.int8), torch.ones(16, 2), 2048)


def test_fake_quantize_is_what_the_kernel_multiplies() -> None:
    """A float matmul over fake_quantize(x) and the dequantized weights: the kernel's
    result up to float32 rounding (what the Hugging Face oracle of a w8a8 engine runs)."""
    qw = cpu_qdot.quantize(_weight(80, 576, 12))
    x = _rows(9, 576, 13, torch.float32)
    expected = torch.nn.functional.linear(cpu_qdot.fake_quantize(x, qw.act_group),
                                          cpu_qdot.dequantize(qw))
    torch.testing.assert_close(cpu_qdot.linear(x, qw), expected, rtol=1e-5, atol=1e-5)
    # ... and far from the float product of the unquantized rows at this tolerance.
    plain = torch.nn.functional.linear(x, cpu_qdot.dequantize(qw))
    assert not torch.allclose(cpu_qdot.linear(x, qw), plain, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- wide activations (int8)
# `--quantization int8` at bf16 on AVX-512 VNNI: the same weights per output channel, each
# row of x as 16-bit integers (one scale per row) split in two bytes, two exact int32 sums
# a column.

# (N, K): blocks of 16 columns in pairs and one left over (16: 1, 48: 2 + 1, 80: 4 + 1);
# inputs from 36 to SmolLM2's 1,536.
WIDE_SHAPES = [(16, 36), (48, 128), (64, 96), (80, 576), (960, 576), (576, 1536)]


def _wide(n: int, k: int, seed: int, group: int | None = None) -> cpu_qdot.QDotWeight:
    from loraplex_kernels import cpu_quant

    q, scales, _, _ = cpu_quant.quantize_integers(_weight(n, k, seed), 8, group)
    return cpu_qdot.pack(q, scales, group, wide=True)


@pytest.mark.parametrize(("n", "k", "group"),
                         [*((n, k, None) for n, k in WIDE_SHAPES),
                          # grouped (the output projection's groups of 32, GGUF's Q8_0), the
                          # activations' sums per group: 16-multiples, and 4 and 12
                          (80, 576, 32), (48, 128, 64), (1024, 576, 32), (32, 36, 4),
                          (16, 96, 12)])
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_linear_equals_the_reference_and_the_generic_build(
    n: int, k: int, group: int | None, rows: int, dtype: torch.dtype
) -> None:
    qw = _wide(n, k, n + k, group)
    assert qw.wide and qw.colsums is not None and qw.grouped == (group is not None)
    assert qw.act_group == (k if group is None else group)
    # Exact integer sums; float32 steps: the high sum (up to ~2^25) converted, times 256
    # plus the low one (grouped: exact in int32, then times each group's scale, added in
    # order), times the scales: a few ulps. bf16 rounds once more.
    _check_against_reference_and_generic(qw, _rows(rows, k, rows, dtype), 2e-6)


@pytest.mark.parametrize(("n", "k"), [(80, 576), (576, 1536)])
def test_wide_activations_keep_bf16_inputs_to_float32_precision(n: int, k: int) -> None:
    """What makes it weight-only int8: over bf16 inputs (with an outlier input 20x the
    rest, as models have) the product is the dequantized weights' well inside the rounding
    of a bf16 output (2^-9 of a value). Against float64 over the same bf16 values, float32
    output: within 5e-4 of the row's largest output (measured 1.6-2.6e-4, the grid's step
    of max |x| / 32767 on the inputs far below the outlier); w8a8's int8 groups are off
    by more than 5e-3 on the same rows (measured 1.4-1.8e-2)."""
    qw = _wide(n, k, 21)
    x = _rows(32, k, 22, torch.bfloat16)
    exact = x.double() @ cpu_qdot.dequantize(qw).double().t()
    scale = exact.abs().amax(1, keepdim=True)
    y = cpu_qdot.linear(x.float(), qw)  # float32 out: no output rounding in the way
    assert float(((y.double() - exact) / scale).abs().max()) <= 5e-4
    narrow = cpu_qdot.linear(x.float(), cpu_qdot.pack(cpu_qdot.integers(qw).to(torch.int8),
                                                      qw.scales))
    assert float(((narrow.double() - exact) / scale).abs().max()) > 5e-3


def test_wide_rows_of_zeros_and_non_finite_rows_stay_their_own() -> None:
    qw = _wide(48, 128, 5)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(6))
    x = _rows(6, 128, 2, torch.bfloat16)
    clean = cpu_qdot.linear(x, qw, bias)
    x[1] = 0.0
    x[3, 7] = float("nan")
    x[4, 100] = float("-inf")
    for generic in (False, True):
        y = cpu_qdot.linear(x, qw, bias, generic=generic)
        assert torch.equal(y[1], bias.bfloat16())
        assert bool(y[3].isnan().all()) and bool(y[4].isnan().all())
        for r in (0, 2, 5):
            assert _same(y[r], clean[r])


def test_wide_activations_quantize_per_row_to_nearest_even() -> None:
    """16-bit integers, one scale per row: s = max |x| / 32767, round half to even."""
    x = torch.zeros(2, 64)
    x[0, :63] = torch.arange(63) - 31.5  # halves
    x[0, 63] = 32767.0  # scale 1
    x[1, 5] = -2.0
    q, s = cpu_qdot.quantize_activations16(x)
    assert float(s[0]) == 1.0 and float(s[1]) == float(torch.tensor(2.0) / 32767)
    assert torch.equal(q[0, :63], torch.round(x[0, :63])) and float(q[0, 2]) == -30.0
    assert float(q[1, 5]) == -32767.0 and int((q[1] != 0).sum()) == 1
    # Weights that read each input once, scale 1: the outputs are the integers times s.
    qw = cpu_qdot.pack(torch.eye(64, dtype=torch.int8), torch.ones(64), wide=True)
    assert torch.equal(cpu_qdot.linear(x, qw), (q * s[:, None]).float())


def test_wide_pack_keeps_column_sums_and_refuses_what_it_cannot() -> None:
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (32, 40), generator=g, dtype=torch.int8)
    qw = cpu_qdot.pack(q, torch.rand(32, generator=g) + 0.1, wide=True)
    assert torch.equal(qw.colsums, q.sum(1, dtype=torch.int32))
    assert qw.nbytes == 32 * 40 + 32 * 4 + 32 * 4
    assert not cpu_qdot.pack(q, torch.ones(32)).wide
    grouped = cpu_qdot.pack(q, torch.ones(32, 5), 8, wide=True)
    sums = q.to(torch.int32).view(32, 5, 8).sum(-1)  # [N, groups] -> [N / 16, groups, 16]
    assert torch.equal(grouped.colsums, sums.view(2, 16, 5).transpose(1, 2))
    with pytest.raises(ValueError, match="groups of 512"):
        cpu_qdot.pack(torch.zeros(16, 1024, dtype=torch.int8), torch.ones(16, 2), 512,
                      wide=True)
    with pytest.raises(ValueError, match="at most 32768"):
        cpu_qdot.pack(torch.zeros(16, 32772, dtype=torch.int8), torch.ones(16), wide=True)
    assert cpu_qdot.wide_fits(16, 32768) and not cpu_qdot.wide_fits(16, 32772)
    assert not cpu_qdot.wide_fits(24, 64) and not cpu_qdot.wide_fits(16, 66)
    assert cpu_qdot.wide_fits(16, 1024, 256) and not cpu_qdot.wide_fits(16, 1024, 512)
    assert not cpu_qdot.wide_fits(16, 96, 10) and not cpu_qdot.wide_fits(16, 96, 64)
