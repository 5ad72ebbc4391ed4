"""The fused CPU kernels (loraplex_kernels/cpu_ops.py) against the torch ops they replace.

RMSNorm on rows that are views, odd widths and extreme magnitudes; the LoRA segments
kernel on random layouts (adapters on some slices only, ranks 1-64, base rows between
adapted ones, cleared and re-filled slots), through LoRAGroup.apply as the model calls it;
SiLU-and-multiply over the whole float range, the K/V write against `index_copy_` (and a
slot outside the cache refused), and the greedy argmax against torch's ranking with NaN,
infinities and ties.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.lora.layers import SMALL_SEGMENT_ROWS, LoRAGroup
from engine.lora.weights import LoRAModule
from engine.models.llama import RMSNorm
from loraplex_kernels import cpu_ops
from loraplex_kernels import reference as ref
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


def _norm_counting(monkeypatch: pytest.MonkeyPatch, kernel_name: str
                   ) -> tuple[RMSNorm, list[int]]:
    """An RMSNorm of 16, and the calls of cpu_ops' `kernel_name` from now on."""
    norm = RMSNorm(16, 1e-6, torch.float32)
    norm.weight = torch.nn.Parameter(torch.randn(16), requires_grad=False)
    calls: list[int] = []
    kernel = getattr(cpu_ops, kernel_name)

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(cpu_ops, kernel_name, counting)
    return norm, calls


def test_rms_norm_module_takes_the_kernel_for_rows_and_torch_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    norm, calls = _norm_counting(monkeypatch, "rms_norm")
    x = torch.randn(5, 16)
    torch.testing.assert_close(norm(x), ref.rms_norm(x, norm.weight, 1e-6))
    assert calls == [1]
    norm(torch.randn(2, 5, 16))  # not [T, H]: the torch op
    norm(torch.randn(5, 16).to(torch.bfloat16).float().t().contiguous().t())  # column-major
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 13), (33, 2048), (300, 64)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(
    dtype: torch.dtype, rows: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden + 3, generator=gen) * 4).to(dtype)[:, 3:]  # strided rows
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual[0] *= 1e4
    weight = torch.randn(hidden, generator=gen).to(dtype)
    summed = x + residual  # torch's add, rounded to dtype
    stream = residual.clone()
    got = cpu_ops.add_rms_norm(x, stream, weight, 1e-5)
    assert torch.equal(stream, summed)  # the stream updated in place, as torch adds
    assert torch.equal(got, cpu_ops.rms_norm(summed, weight, 1e-5))  # then the same norm
    assert got.is_contiguous() and got.dtype == dtype


def test_add_forward_fuses_on_rows_and_adds_then_norms_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    norm, calls = _norm_counting(monkeypatch, "add_rms_norm")
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    stream = residual.clone()
    torch.testing.assert_close(norm.add_forward(x, stream),
                               ref.rms_norm(x + residual, norm.weight, 1e-6))
    assert torch.equal(stream, x + residual) and calls == [1]
    # A residual that is not contiguous: torch's add in place, then the norm.
    stream = residual.t().contiguous().t()
    got = norm.add_forward(x, stream)
    assert calls == [1]
    assert torch.equal(stream, x + residual)
    torch.testing.assert_close(got, ref.rms_norm(x + residual, norm.weight, 1e-6))


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 7), (2, 1100), (300, 1536)])
def test_silu_mul_matches_torch(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter + 5, generator=gen)[:, 5:] * 8  # strided rows
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 80.0, -80.0, 87.0, -87.0])
    gate_up[0, : min(inter, edge.numel())] = edge[:inter]
    got = cpu_ops.silu_mul(gate_up)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert got.shape == (rows, inter) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_silu_mul_exp_is_float32_accurate_over_the_range() -> None:
    x = torch.linspace(-87.0, 88.0, 1_000_001)
    gate_up = torch.stack([x, torch.ones_like(x)], dim=1).contiguous()
    got = cpu_ops.silu_mul(gate_up)[:, 0].double()
    exact = F.silu(x.double())
    relative = (got - exact).abs() / exact.abs().clamp_min(1e-300)
    assert relative.max().item() < 4e-7  # a few float32 ulps
    assert cpu_ops.silu_mul(torch.tensor([[float("nan"), 2.0]])).isnan().all()
    big = cpu_ops.silu_mul(torch.tensor([[1e4, 2.0], [-1e4, 2.0]]))
    assert big[0, 0].item() == 2e4 and -1e-30 < big[1, 0].item() <= 0.0


def test_write_kv_matches_index_copy_and_refuses_a_slot_outside() -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(40, 15 * 64, generator=gen)
    key = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64)  # views with a token stride, as the model's
    value = qkv[:, 12 * 64 :].view(40, 3, 64)
    slots = torch.randperm(20 * 16, generator=gen)[:40]
    got = [torch.zeros(20, 16, 3, 64) for _ in range(2)]
    want = [torch.zeros(20, 16, 3, 64) for _ in range(2)]
    cpu_ops.write_kv(key, value, got[0], got[1], slots)
    ref.write_kv_cache(key, value, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    before = [t.clone() for t in got]
    for bad in (20 * 16, -1):
        with pytest.raises(IndexError):
            cpu_ops.write_kv(key[:2], value[:2], got[0], got[1], torch.tensor([0, bad]))
    assert all(torch.equal(a, b) for a, b in zip(got, before, strict=True))  # nothing written


def test_argmax_rows_ranks_as_the_sampler_does() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 49152, generator=gen)
    nan, inf = float("nan"), float("inf")
    logits[0, 5] = nan  # a NaN never wins over a number
    logits[1] = nan  # NaN only: a valid id
    logits[2] = -inf
    logits[2, 7] = nan
    logits[3, 100] = logits[3, 200] = inf  # the first of equal maxima
    logits[4, 10] = logits[4, 20] = 99.0
    logits[5] = -inf
    logits[5, 49151] = -1.0
    got = cpu_ops.argmax_rows(logits[:, 1:])  # rows with a stride
    want = logits[:, 1:].nan_to_num(nan=-inf, posinf=inf, neginf=-inf).argmax(dim=-1)
    assert got.tolist() == want.tolist()
    assert got[:6].tolist() == [logits[0, 1:].nan_to_num(nan=-inf).argmax().item(), 0, 0, 99,
                                9, 49150]
    assert cpu_ops.argmax_rows(torch.empty(0, 5)).shape == (0,)


def _group(slots: dict[int, list[LoRAModule | None]], *, kernel: bool,
           dtype: torch.dtype = torch.float32) -> LoRAGroup:
    group = LoRAGroup(6, 64, IN, SLICES, device=CPU, dtype=dtype)
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


# ------------------------------------------------------------------------------ bf16
# Each bf16 kernel computes in float32 and rounds where the Hugging Face model's bf16 ops
# round; it is held to that model's own formula (RMSNorm, SiLU and multiply) or to float32
# over the same bf16 values, rounded once (the K/V write copies bits exactly).

BF16_HALF_ULP = 2**-8  # relative: half the spacing of bf16 numbers (8 significant bits)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in float32, round, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 13), (33, 2048), (300, 64)])
def test_bf16_rms_norm_matches_the_hf_formula(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden + 3, generator=gen) * 3)[:, 3:].bfloat16()
    x[0] *= 1e4
    weight = torch.randn(hidden, generator=gen).bfloat16()
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    want = _hf_rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    # The row's scale is computed in double here, in float32 by HF: a normalized value
    # that lies on a rounding boundary may round the other way (one ulp, seldom).
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * BF16_HALF_ULP, atol=1e-30)
    assert (got == want).float().mean() > 0.97


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 7), (2, 1100), (300, 1536)])
def test_bf16_silu_mul_matches_the_hf_formula(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter + 5, generator=gen) * 8)[:, 5:].bfloat16()
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 80.0, -80.0, 87.0, -87.0])
    gate_up[0, : min(inter, edge.numel())] = edge[:inter].bfloat16()
    got = cpu_ops.silu_mul(gate_up)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # two bf16 ops, as HF's MLP
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * BF16_HALF_ULP, atol=1e-30)
    assert (got == want).float().mean() > 0.97
    assert cpu_ops.silu_mul(torch.tensor([[float("nan"), 2.0]]).bfloat16()).isnan().all()


def test_bf16_write_kv_copies_the_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(40, 15 * 64, generator=gen).bfloat16()
    key = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64)
    value = qkv[:, 12 * 64 :].view(40, 3, 64)
    slots = torch.randperm(20 * 16, generator=gen)[:40]
    got = [torch.zeros(20, 16, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    want = [torch.zeros(20, 16, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    cpu_ops.write_kv(key, value, got[0], got[1], slots)
    ref.write_kv_cache(key, value, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(IndexError):
        cpu_ops.write_kv(key[:1], value[:1], got[0], got[1], torch.tensor([20 * 16]))


def _rounded(modules: list[LoRAModule | None]) -> list[LoRAModule | None]:
    """The same adapter with its weights rounded to bf16 values (kept as float32)."""
    return [None if m is None else LoRAModule(a=m.a.bfloat16().float(),
                                              b=m.b.bfloat16().float(), scaling=m.scaling)
            for m in modules]


@pytest.mark.parametrize("seed", range(4))
def test_bf16_lora_segments_are_float32_over_the_same_values_rounded_once(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    choices = [[16, 16, 16], [1, 0, 7], [0, 64, 0], [3, 3, 0], [0, 0, 0], [64, 64, 64]]
    slots = {slot: _rounded(random_modules(gen, choices[(slot + seed) % len(choices)]))
             for slot in range(6)}
    token_slots = torch.randint(-1, 6, (SMALL_SEGMENT_ROWS,), generator=gen).tolist()
    token_slots[0] = seed  # at least one adapted row
    segs = ref.LoRASegments.from_token_slots(token_slots)
    assert segs is not None
    x = torch.randn(len(token_slots), IN, generator=gen).bfloat16()
    y0 = (torch.randn(len(token_slots), sum(SLICES), generator=gen) * 30).bfloat16()
    group = _group(slots, kernel=True, dtype=torch.bfloat16)
    assert group.cpu_kernel
    got = y0.clone()
    group.apply(got, x, segs)
    exact = y0.float()
    _group(slots, kernel=True).apply(exact, x.float(), segs)
    torch.testing.assert_close(got.float(), exact, rtol=BF16_HALF_ULP + 1e-5, atol=1e-6)
    base_rows = [row for row, slot in enumerate(token_slots) if slot == -1]
    assert torch.equal(got[base_rows], y0[base_rows])


@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 12, 64), (37, 4, 8), (300, 12, 64)])
def test_bf16_rope_in_place_rotates_as_the_reference(tokens: int, heads: int,
                                                      head_dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2) * head_dim, generator=gen) * 4).bfloat16()
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # a view, as the model's
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 100
    rope = torch.polar(torch.ones_like(angles), angles)
    want = ref.apply_rope_interleaved(qk, rope)  # float32 rotation, rounded once
    rest = qkv[:, heads * head_dim :].clone()
    cpu_ops.rope_in_place(qk, rope)
    torch.testing.assert_close(qk.float(), want.float(), rtol=2 * BF16_HALF_ULP, atol=1e-30)
    assert (qk == want).float().mean() > 0.99
    assert torch.equal(qkv[:, heads * head_dim :], rest)  # only the rotated heads change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "head_dim", "offset"),
    [
        (40, 64, 0),  # whole 64-byte lines at aligned slots: streaming stores
        (40, 8, 0),  # rows of 48 or 96 bytes: copied
        (40, 64, 1),  # the cache one element off a line: copied
        (2048, 64, 0),  # a prefill's rows, written by every thread
    ],
)
def test_write_kv_streamed_or_copied_rows_land_in_their_slots(
    dtype: torch.dtype, num_tokens: int, head_dim: int, offset: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + head_dim + offset)
    row = 3 * head_dim
    qkv = torch.randn(num_tokens, 15 * head_dim, generator=gen).to(dtype)
    key = qkv[:, 9 * head_dim : 12 * head_dim].view(num_tokens, 3, head_dim)
    value = qkv[:, 12 * head_dim :].view(num_tokens, 3, head_dim)
    num_blocks = -(-num_tokens // 16) + 4
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens]
    # A cache starting `offset` elements into its storage (not on a 64-byte line).
    got = [torch.full((num_blocks * 16 * row + offset,), 7.0, dtype=dtype)[offset:]
           .view(num_blocks, 16, 3, head_dim) for _ in range(2)]
    want = [torch.full((num_blocks, 16, 3, head_dim), 7.0, dtype=dtype) for _ in range(2)]
    cpu_ops.write_kv(key, value, got[0], got[1], slots)
    ref.write_kv_cache(key, value, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
