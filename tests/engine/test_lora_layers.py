"""The CPU layout (PackedLoRA, add_lora_packed) computes what the slot-stacked reference
(lora_shrink + lora_expand) defines, and LoRAGroup installs/clears slots correctly."""

from __future__ import annotations

import pytest
import torch

from engine.lora.layers import LoRAGroup
from engine.lora.weights import LoRAModule
from loraplex_kernels import reference as ref

SLICES = (48, 16, 16)
IN = 40
MAX_RANK = 16


def random_modules(g: torch.Generator, ranks: list[int]) -> list[LoRAModule | None]:
    modules: list[LoRAModule | None] = []
    for k, r in enumerate(ranks):
        if r == 0:
            modules.append(None)
            continue
        a = torch.randn(r, IN, generator=g)
        b = torch.randn(SLICES[k], r, generator=g)
        modules.append(LoRAModule(a=a, b=b, scaling=0.5 + k))
    return modules


def stacked_buffers(
    slots: dict[int, list[LoRAModule | None]], num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    offsets = (0, 48, 64, 80)
    lora_a = torch.full((num_slots, 3, MAX_RANK, IN), float("nan"))
    lora_b = torch.full((num_slots, offsets[-1], MAX_RANK), float("nan"))
    ranks = torch.zeros(num_slots, 3, dtype=torch.int32)
    scalings = torch.zeros(num_slots, 3)
    for slot, modules in slots.items():
        for k, m in enumerate(modules):
            if m is None:
                continue
            lora_a[slot, k, : m.rank] = m.a
            lora_b[slot, offsets[k] : offsets[k + 1], : m.rank] = m.b
            ranks[slot, k] = m.rank
            scalings[slot, k] = m.scaling
    return lora_a, lora_b, ranks, scalings, offsets


@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 1, 2, 3, 0, 1, 2, 3],  # distinct-ish
        [2, 2, 2, 2, 2, -1, 2, 2],  # one adapter, one base row
        [-1, 3, -1, 0, 0, 0, 0, 1, 3, -1, 2],  # skewed with base rows
    ],
)
def test_packed_cpu_path_equals_reference(token_slots: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    slots = {
        0: random_modules(g, [16, 16, 16]),
        1: random_modules(g, [2, 0, 7]),  # k not targeted
        2: random_modules(g, [1, 1, 1]),
        3: random_modules(g, [0, 5, 0]),  # only k
    }
    x = torch.randn(len(token_slots), IN, generator=g)
    y0 = torch.randn(len(token_slots), 80, generator=g)
    segs = ref.LoRASegments.from_token_slots(token_slots)
    assert segs is not None
    lora_a, lora_b, ranks, scalings, offsets = stacked_buffers(slots, 5)
    want = y0.clone()
    ref.lora_expand(
        want, ref.lora_shrink(x, lora_a, ranks, segs), lora_b, ranks, scalings, offsets, segs
    )
    group = LoRAGroup(5, MAX_RANK, IN, SLICES, device=torch.device("cpu"), dtype=torch.float32)
    for slot, modules in slots.items():
        group.set_slot(slot, modules)
    got = y0.clone()
    group.apply(got, x, segs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base_rows], y0[base_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_cpu_path(dtype: torch.dtype) -> None:
    """The stacked buffers + Triton kernels (the CUDA path, here in the interpreter) and the
    packed CPU path give the same result for the same installed adapters."""
    g = torch.Generator().manual_seed(2)
    slots = {0: random_modules(g, [3, 3, 3]), 2: random_modules(g, [9, 0, 4])}
    token_slots = [2, -1, 0, 2, 2, 0, -1]
    segs = ref.LoRASegments.from_token_slots(token_slots)
    assert segs is not None
    x = torch.randn(len(token_slots), IN, generator=g).to(dtype)
    y0 = torch.randn(len(token_slots), 80, generator=g).to(dtype)
    results = []
    for use_kernels in (False, True):
        group = LoRAGroup(
            3,
            MAX_RANK,
            IN,
            SLICES,
            device=torch.device("cpu"),
            dtype=dtype,
            use_kernels=use_kernels,
        )
        for slot, modules in slots.items():
            group.set_slot(slot, modules)
        y = y0.clone()
        group.apply(y, x, segs)
        results.append(y)
    # bf16: the CPU path rounds the delta to bf16 before adding it, the kernel does not.
    tol = 1e-5 if dtype == torch.float32 else 1e-1
    torch.testing.assert_close(results[1].float(), results[0].float(), rtol=tol, atol=tol)
    assert torch.equal(results[1][[1, 6]], y0[[1, 6]])


def test_cleared_slot_adds_nothing_and_reinstall_replaces() -> None:
    g = torch.Generator().manual_seed(1)
    group = LoRAGroup(2, MAX_RANK, IN, SLICES, device=torch.device("cpu"), dtype=torch.float32)
    first, second = random_modules(g, [4, 4, 4]), random_modules(g, [8, 0, 2])
    x = torch.randn(3, IN, generator=g)
    segs = ref.LoRASegments.from_token_slots([1, 1, 1])
    assert segs is not None
    group.set_slot(1, first)
    group.set_slot(1, second)  # a new adapter in the same slot
    got = torch.zeros(3, 80)
    group.apply(got, x, segs)
    only_second = LoRAGroup(
        2, MAX_RANK, IN, SLICES, device=torch.device("cpu"), dtype=torch.float32
    )
    only_second.set_slot(1, second)
    want = torch.zeros(3, 80)
    only_second.apply(want, x, segs)
    assert torch.equal(got, want)
    assert torch.count_nonzero(got[:, 48:64]) == 0  # k slice not targeted by `second`
    group.clear_slot(1)
    cleared = torch.zeros(3, 80)
    group.apply(cleared, x, segs)
    assert torch.count_nonzero(cleared) == 0


@pytest.mark.parametrize("use_kernels", [False, True])
def test_single_slice_group_adds_the_fused_module_delta(use_kernels: bool) -> None:
    """A group carrying one module over its whole output (Phi-3's fused qkv_proj)."""
    g = torch.Generator().manual_seed(4)
    out = sum(SLICES)
    a, b = torch.randn(6, IN, generator=g), torch.randn(out, 6, generator=g)
    group = LoRAGroup(
        2, MAX_RANK, IN, (out,), device=torch.device("cpu"), dtype=torch.float32,
        use_kernels=use_kernels,
    )
    group.set_slot(1, [LoRAModule(a=a, b=b, scaling=0.25)])
    x = torch.randn(5, IN, generator=g)
    segs = ref.LoRASegments.from_token_slots([1, -1, 1, 1, -1])
    assert segs is not None
    y = torch.zeros(5, out)
    group.apply(y, x, segs)
    want = 0.25 * (x @ a.T) @ b.T
    torch.testing.assert_close(y[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(y[[1, 4]]) == 0


def test_slots_install_each_groups_modules_by_name() -> None:
    """LoRASlots routes an adapter's modules by the architecture's group -> modules map."""
    from engine.lora.layers import LoRASlots
    from engine.lora.weights import LoRAWeights

    g = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    fused = LoRAGroup(2, MAX_RANK, IN, (80,), device=cpu, dtype=torch.float32)
    split = LoRAGroup(2, MAX_RANK, IN, SLICES, device=cpu, dtype=torch.float32)
    slots = LoRASlots(
        [{"qkv": fused, "split": split}], {"qkv": ("qkv_proj",), "split": ("a", "b", "c")}
    )
    assert (slots.num_slots, slots.max_rank) == (2, MAX_RANK)
    module = LoRAModule(torch.randn(3, IN, generator=g), torch.randn(80, 3, generator=g), 1.0)
    only_b = LoRAModule(torch.randn(2, IN, generator=g), torch.randn(16, 2, generator=g), 1.0)
    weights = LoRAWeights("w", None, 3, 3.0, False, {(0, "qkv_proj"): module, (0, "b"): only_b})
    slots.install(1, weights)
    assert fused.ranks[1].tolist() == [3]
    assert split.ranks[1].tolist() == [0, 2, 0]
    slots.clear(1)
    assert not fused.slot_active[1] and not split.slot_active[1]


def test_a_cpu_slot_reads_the_host_copy_in_place() -> None:
    """The loader's layout (A rows, B as the transpose of contiguous B^T) is installed
    without a copy: the slot's tensors are the host cache's."""
    g = torch.Generator().manual_seed(6)
    modules = [
        LoRAModule(a=torch.randn(r, IN, generator=g),
                   b=torch.randn(r, size, generator=g).t(), scaling=1.0)
        for r, size in zip((4, 2, 3), SLICES, strict=True)
    ]
    group = LoRAGroup(2, MAX_RANK, IN, SLICES, device=torch.device("cpu"), dtype=torch.float32)
    group.set_slot(0, modules)
    packed = group.packed[0]
    assert packed is not None and len(packed.slices) == 3
    for (a, b_t, _, lo, hi), module in zip(packed.slices, modules, strict=True):
        assert a.data_ptr() == module.a.data_ptr()
        assert b_t.data_ptr() == module.b.data_ptr() and b_t.shape == (module.rank, hi - lo)
