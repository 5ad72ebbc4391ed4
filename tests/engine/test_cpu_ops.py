"""The fused CPU kernels (kernels/cpu_ops.py) against the torch ops they replace.

RMSNorm on rows that are views, odd widths and extreme magnitudes; the LoRA segments
kernel on random layouts (adapters on some slices only, ranks 1-64, base rows between
adapted ones, cleared and re-filled slots), through LoRAGroup.apply as the model calls it.
"""

from __future__ import annotations

import pytest
import torch

from engine.lora.layers import SMALL_SEGMENT_ROWS, LoRAGroup
from engine.lora.weights import LoRAModule
from engine.models.llama import RMSNorm
from kernels import cpu_ops
from kernels import reference as ref
from tests.engine.test_lora_layers import IN, SLICES, random_modules

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not cpu_ops.available(CPU, torch.float32), reason="no C compiler for the CPU kernels"
)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 13), (33, 2048), (300, 64)])
def test_rms_norm_matches_torch(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden + 3, generator=gen)[:, 3:]  # rows with a stride
    x[0] *= 1e4
    weight = torch.randn(hidden, generator=gen)
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    want = ref.rms_norm(x, weight, 1e-5)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_rms_norm_module_takes_the_kernel_for_rows_and_torch_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    norm = RMSNorm(16, 1e-6, torch.float32)
    norm.weight = torch.nn.Parameter(torch.randn(16), requires_grad=False)
    calls: list[int] = []
    kernel = cpu_ops.rms_norm

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_ops, "rms_norm", counting)
    x = torch.randn(5, 16)
    torch.testing.assert_close(norm(x), ref.rms_norm(x, norm.weight, 1e-6))
    assert calls == [1]
    norm(torch.randn(2, 5, 16))  # not [T, H]: the torch op
    norm(torch.randn(5, 16).to(torch.bfloat16).float().t().contiguous().t())  # column-major
    assert calls == [1]


def _group(slots: dict[int, list[LoRAModule | None]], *, kernel: bool) -> LoRAGroup:
    group = LoRAGroup(6, 64, IN, SLICES, device=CPU, dtype=torch.float32)
    assert group.cpu_kernel
    group.cpu_kernel = kernel
    for slot, modules in slots.items():
        group.set_slot(slot, modules)
    return group


@pytest.mark.parametrize("seed", range(6))
def test_lora_segments_kernel_matches_the_packed_matmuls(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    choices = [[16, 16, 16], [1, 0, 7], [0, 64, 0], [3, 3, 0], [0, 0, 0], [64, 64, 64]]
    slots = {slot: random_modules(gen, choices[(slot + seed) % len(choices)]) for slot in range(6)}
    num_rows = int(torch.randint(1, SMALL_SEGMENT_ROWS, (1,), generator=gen))
    token_slots = torch.randint(-1, 6, (num_rows,), generator=gen).tolist()
    segs = ref.LoRASegments.from_token_slots(token_slots)
    if segs is None:
        token_slots[0] = 0
        segs = ref.LoRASegments.from_token_slots(token_slots)
    assert segs is not None
    x = torch.randn(num_rows, IN, generator=gen)
    y0 = torch.randn(num_rows, sum(SLICES), generator=gen)
    results = []
    for kernel in (True, False):
        y = y0.clone()
        _group(slots, kernel=kernel).apply(y, x, segs)
        results.append(y)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-4)
    empty = (4 - seed) % len(choices)  # the slot holding [0, 0, 0]
    untouched = [row for row, slot in enumerate(token_slots) if slot in (-1, empty)]
    assert torch.equal(results[0][untouched], y0[untouched])  # base rows, empty adapter


def test_lora_segments_kernel_follows_clears_and_reinstalls() -> None:
    gen = torch.Generator().manual_seed(9)
    group = _group({1: random_modules(gen, [4, 4, 4])}, kernel=True)
    x = torch.randn(3, IN, generator=gen)
    segs = ref.LoRASegments.from_token_slots([1, -1, 1])
    assert segs is not None
    second = random_modules(gen, [0, 8, 0])
    group.set_slot(1, second)
    got = torch.zeros(3, sum(SLICES))
    group.apply(got, x, segs)
    want = torch.zeros(3, sum(SLICES))
    _group({1: second}, kernel=False).apply(want, x, segs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[:, :48]) == 0 and torch.count_nonzero(got[1]) == 0
    group.clear_slot(1)
    assert group.desc[1].count_nonzero() == 0
    cleared = torch.zeros(3, sum(SLICES))
    group.apply(cleared, x, segs)
    assert torch.count_nonzero(cleared) == 0


def test_long_segments_keep_the_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    group = _group({0: random_modules(gen, [8, 8, 8])}, kernel=True)
    monkeypatch.setattr(cpu_ops, "lora_segments", lambda *a: pytest.fail("kernel called"))
    segs = ref.LoRASegments.from_token_slots([0] * (SMALL_SEGMENT_ROWS + 1))
    assert segs is not None
    x = torch.randn(SMALL_SEGMENT_ROWS + 1, IN, generator=gen)
    y = torch.zeros(SMALL_SEGMENT_ROWS + 1, sum(SLICES))
    group.apply(y, x, segs)
    assert torch.count_nonzero(y) > 0
