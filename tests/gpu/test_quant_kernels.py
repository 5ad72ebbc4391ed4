"""triton_quant's weight-only int8 / int4 kernel against device_quant's definition of
the product (float64 over the dequantized weight), compiled on CUDA, interpreted on the
CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.gpu.models import Plan
from loraplex_kernels import cpu_quant, device_quant
from loraplex_kernels.triton_quant import block_sizes, quant_linear

# (bits, group): int8 per channel (None) and in groups, int4 in GPTQ/AWQ's 128 and our 32.
SCHEMES = [(8, None), (8, 32), (4, 32), (4, 128)]


def make_weight(n: int, k: int, bits: int, group: int | None, device: torch.device,
                seed: int) -> device_quant.DeviceQuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scales, offsets, g = cpu_quant.quantize_integers(w, bits, group)
    return device_quant.pack(q, scales, offsets, bits, g, device)


def bound(x: torch.Tensor, qw: device_quant.DeviceQuantizedWeight) -> torch.Tensor:
    """What one output may differ by: float32 sums (1e-5 of the magnitudes' sum), and for
    16-bit outputs two roundings of the result (triton's interpreter truncates where the
    compiled kernel rounds to nearest)."""
    magnitude = x.double().abs() @ device_quant.dequantize(qw).double().abs().t()
    if x.dtype == torch.float32:
        return 1e-5 * magnitude + 1e-6
    eps = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -10
    return 2 * eps * magnitude + 1e-3


@pytest.mark.parametrize("bits,group", SCHEMES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_the_definition(bits: int, group: int | None, dtype: torch.dtype,
                                       device: torch.device) -> None:
    # 80 columns: one full 64-column program and a masked one; K of 256: two int4 groups
    # of 128, several K tiles.
    n, k = 80, 256
    qw = make_weight(n, k, bits, group, device, seed=bits + (group or 0))
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen).to(device)
    # The bias at one row count only: each (BLOCK_M, bias) pair is a compile on a GPU.
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
        for b in ((None, bias) if rows == 17 else (None,)):
            got = quant_linear(x, qw, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            want = device_quant.reference_linear(x, qw, b)
            err = (got.double() - want).abs()
            assert bool((err <= bound(x, qw)).all()), (
                f"{rows} rows, bias {b is not None}: max error {err.max().item():.3g}")


def test_offsets_and_scales_are_read_per_group_and_column(device: torch.device) -> None:
    """Every group of every column with its own scale and offset: a kernel that read the
    wrong group's (or one column's for all) fails."""
    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1))
    scales = torch.arange(1, n * k // group + 1, dtype=torch.float32).reshape(n, -1) / 64
    offsets = -torch.arange(n * k // group, dtype=torch.float32).reshape(n, -1) / 8
    qw = device_quant.pack(q, scales, offsets, 4, group, device)
    x = torch.eye(k, device=device)[:32]  # rows of one input each: y[t] = w[:, t]
    got = quant_linear(x, qw)
    want = (q.float().view(n, -1, group) * scales[..., None] + offsets[..., None]).view(n, k)
    assert torch.equal(got.cpu(), want[:, :32].t().contiguous())


def test_strided_rows_and_an_empty_step(device: torch.device) -> None:
    qw = make_weight(48, 64, 8, None, device, seed=3)
    wide = torch.randn(6, 128, device=device)
    x = wide[:, 32:96]  # rows 128 apart
    assert torch.allclose(quant_linear(x, qw), quant_linear(x.contiguous(), qw))
    empty = quant_linear(torch.empty(0, 64, device=device), qw)
    assert empty.shape == (0, 48)


def test_refusals(device: torch.device) -> None:
    qw = make_weight(16, 64, 8, None, device, seed=4)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        quant_linear(torch.zeros(2, 32, device=device), qw)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        quant_linear(torch.zeros(2, 64, dtype=torch.float64, device=device), qw)
    odd = make_weight(16, 24, 4, 6, device, seed=5)
    assert odd.kernel_block_k is None
    with pytest.raises(ValueError, match="no K tile"):
        quant_linear(torch.zeros(2, 24, device=device), odd)


def test_block_sizes_cover_every_row_count() -> None:
    for rows in (1, 16, 17, 32, 33, 64):
        block_m, block_n, _ = block_sizes(rows, 576, 64)
        assert block_m >= 16 and block_n == 64
        assert block_m >= min(rows, 64) or rows > 32
    assert block_sizes(1, 48, 32) == (16, 64, 32)
    assert block_sizes(1, 16, 32) == (16, 16, 32)


def random_weight(n: int, k: int, bits: int, group: int | None,
                  device: torch.device) -> device_quant.DeviceQuantizedWeight:
    """Random integers, scales and offsets of a weight's magnitude (quantizing a
    Llama-3-8B-sized matrix on the host would take the check's time)."""
    g = k if group is None or k % group else group
    q = (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device) if bits == 8
         else torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device))
    scales = torch.rand(n, k // g, device=device) * (0.05 / 127 if bits == 8 else 0.1 / 15)
    offsets = -7.5 * scales if bits == 4 else None
    return device_quant.pack(q, scales, offsets, bits, g, device)


def test_quant_kernel_at_model_shapes(plan: Plan, device: torch.device,
                        record_property: Callable[[str, object], None]) -> None:
    """The plan's model's linear shapes (hidden, intermediate) at decode step sizes, every
    scheme, bf16: the figures the GPU check records."""
    hidden, intermediate = plan.kernel_dims[:2]
    for bits, group in SCHEMES:
        for n, k in ((hidden, hidden), (intermediate, hidden), (hidden, intermediate)):
            qw = random_weight(n, k, bits, group, device)
            for rows in (1, 16, 64):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                got = quant_linear(x, qw)
                err = (got.double() - device_quant.reference_linear(x, qw)).abs()
                record_property(f"int{bits}/g{group}/{n}x{k}/{rows}/max_abs_err",
                                err.max().item())
                assert bool((err <= bound(x, qw)).all()), (bits, group, n, k, rows)
            del qw
