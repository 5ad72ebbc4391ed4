"""lora_shrink / lora_expand against loraplex_kernels/reference.py at serving shapes (the
plan's Llama layer: qkv, o, gate_up, down), ranks 8-64 mixed across slots and slices, on
distinct and on skewed adapters, fp16 and bf16 with per-dtype tolerances. Each case's
error is recorded (junit properties: the GPU check's report keeps them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.gpu.kernel_checks import (
    BatchSpec,
    LoRAProblem,
    expand,
    llama_groups,
    make_mixed_problem,
    shrink,
)
from bench.gpu.models import Plan
from loraplex_kernels import reference as ref
from tests.gpu.test_lora_kernels import TOLERANCES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_serving_shapes_match_the_reference(
    dtype: torch.dtype, plan: Plan, device: torch.device,
    record_property: Callable[[str, object], None],
) -> None:
    rtol, atol = TOLERANCES[dtype]
    groups = llama_groups(*plan.kernel_dims)
    batches = [BatchSpec(*spec) for spec in plan.accuracy_batches]
    worst = {"shrink": 0.0, "expand": 0.0}
    outside: list[str] = []
    for gi, group in enumerate(groups):
        for bi, spec in enumerate(batches):
            p: LoRAProblem = make_mixed_problem(group, spec, dtype, device, seed=100 * gi + bi)
            got_shrunk = shrink(p)
            y0 = p.y.clone()
            expand(p)
            got_y, p.y = p.y, y0.clone()
            ref.lora_expand(p.y, p.shrunk, p.lora_b, p.ranks, p.scalings, p.slice_offsets,
                            p.segs)
            for op, got, want in (("shrink", got_shrunk, p.shrunk), ("expand", got_y, p.y)):
                got32, want32 = got.float(), want.float()
                err = (got32 - want32).abs().max().item()
                worst[op] = max(worst[op], err)
                record_property(f"{group.name}/{spec.name}/{op}/max_abs_err", err)
                if not (torch.isfinite(got32).all()
                        and torch.allclose(got32, want32, rtol=rtol, atol=atol)):
                    outside.append(f"{group.name} {spec.name} {op}: {err:.3g}")
            del p, got_shrunk, got_y, y0
    record_property("hidden", plan.kernel_dims[0])
    record_property("compiled", device.type == "cuda")
    for op, err in worst.items():
        record_property(f"worst/{op}/max_abs_err", err)
    assert outside == [], f"outside rtol={rtol}, atol={atol}: {outside}"
