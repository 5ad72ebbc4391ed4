"""oneDNN-packed linear layers agree with F.linear; decode grouping keeps outputs exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.model_runner import decode_group_sizes
from engine.models.cpu_linear import PackedLinear, pack_linears, packing_available

needs_packing = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN linear ops",
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    got = PackedLinear(weight, b)(x)
    want = F.linear(x, weight, b)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bf16 linear kernels for this CPU")
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
def test_packed_bf16_linear_is_float32_accumulation_rounded_once(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    got = PackedLinear(weight, b)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    exact = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8 + 1e-5, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=2**-7, atol=1e-3)


@needs_packing
def test_pack_linears_replaces_every_linear_and_ties_lm_head() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.inner = nn.ModuleList([nn.Linear(16, 4)])
            self.lm_head: nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[0](torch.relu(self.up(x)))

    model = Tiny()
    x = torch.randn(5, 8)
    want = model(x)
    embedding = torch.randn(30, 4)
    assert pack_linears(model, lm_head_weight=embedding) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    head = model.lm_head
    assert isinstance(head, PackedLinear)
    torch.testing.assert_close(head(want), want @ embedding.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("widths", "sizes"),
    [
        ([], None),
        ([5], [1]),
        ([9, 9, 9, 9, 9, 9], [6]),
        # 40 blocks, then 3 more at 30+ (>= 0.75 * 40), then the group is closed at 20
        ([40, 39, 31, 30, 20, 20, 19, 15, 14, 2], [4, 4, 2]),
        # a group is never closed below four members, however wide the spread
        ([40, 10, 5, 1, 1], [4, 1]),
    ],
)
def test_decode_group_sizes(widths: list[int], sizes: list[int] | None) -> None:
    assert decode_group_sizes(widths) == sizes
