"""CPU transform: every linear layer of a loaded model runs on packed weights.

NOTE: applied from outside the model after its weights are loaded (the model itself
knows only `nn.Linear`). oneDNN's blocked weight layout makes the skinny matmuls of a
decode step (a few to a few dozen rows against the whole weight) about twice as fast
as `F.linear` on plain row-major weights on AVX2 CPUs, and prefill a little faster;
`bench/` records the effect. Results agree with `F.linear` to float32 rounding.

bfloat16 layers run on loraplex_kernels/cpu_gemm.py where the CPU has bf16 instructions
(`cpu_gemm.role()`); they sum in float32 and round once, as `F.linear` in bf16 does:
- with AMX, steps of up to 32 rows (a decode step's) run on its tiles, about 1.5x as fast as
  oneDNN there, and larger steps on oneDNN's packed bf16 matmul: the layer holds its
  weights twice (EngineConfig cpu_amx False: oneDNN alone);
- with AVX-512 BF16 and no AMX (AMD Zen 4), every step runs on the dot-product kernel,
  which reaches the CPU's bf16 peak from 8 rows where oneDNN needs ~128: one copy, in the
  kernel's layout (EngineConfig cpu_gemm False: oneDNN alone).
Elsewhere bf16 weights are packed for oneDNN where it has bf16 kernels for the CPU
(`_is_mkldnn_bf16_supported`), and float32 weights always.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex_kernels import cpu_gemm

log = logging.getLogger("loraplex.engine")

# The batch size oneDNN tunes the packed layout for; any row count works at run time.
PACKING_ROWS_HINT = 32


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    if not (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout, cpu_gemm's, or both (see the
    module's docstring). x [T, IN] -> [T, OUT]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        role = None
        if weight.dtype == torch.bfloat16 and cpu_gemm.fits(*weight.shape):
            role = cpu_gemm.role()
        # "tiles": the kernel for steps of up to 32 rows; "every_step": for all of them.
        self.kernel_role = role
        kernel = None if role is None else cpu_gemm.pack_weight(weight.detach())
        self.kernel_weight: torch.Tensor | None
        self.register_buffer("kernel_weight", kernel, persistent=False)
        packed = None
        if role != "every_step":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        self.packed_weight: torch.Tensor | None
        self.register_buffer("packed_weight", packed, persistent=False)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether this step runs on cpu_gemm (x 2-D bf16, unit stride within rows)."""
        if self.kernel_weight is None or x.dim() != 2 or x.shape[0] == 0:
            return False
        if self.kernel_role == "tiles":
            return (x.shape[0] <= cpu_gemm.MAX_TILE_ROWS and x.stride(1) == 1
                    and cpu_gemm.uses_tiles())
        return cpu_gemm.available()

    def _on_kernel(self, fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """cpu_gemm's `fn` (linear or linear_silu_mul) on x and this layer's weights."""
        assert self.kernel_weight is not None
        return fn(x if x.stride(1) == 1 else x.contiguous(), self.kernel_weight,
                  self.out_features, self.bias, tiles=self.kernel_role == "tiles")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_takes(x):
            return self._on_kernel(cpu_gemm.linear, x)
        if self.packed_weight is None:  # the kernel switched off since: its weights, unpacked
            assert self.kernel_weight is not None
            weight = cpu_gemm.unpack_weight(self.kernel_weight, self.out_features)
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [None], ""
        )

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate_up layer (the gate rows, then the up rows): silu(gate) * up of
        its output, [T, OUT / 2], in the same kernel pass as the matmul; None where the
        kernel does not take x (the caller then runs forward and the SiLU).

        NOTE: the same values bit for bit, without the [T, OUT] product written and read
        back: at 32 rows that pass was 66 us of a layer's ~1.3 ms decode step on AMX."""
        if self._kernel_takes(x) and cpu_gemm.silu_mul_fits(self.out_features):
            return self._on_kernel(cpu_gemm.linear_silu_mul, x)
        return None

    def extra_repr(self) -> str:
        layout = "packed" if self.kernel_role is None else f"packed, cpu_gemm {self.kernel_role}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def kernel_weight_bytes(model: nn.Module, role: str | None = None) -> int:
    """The bytes of `model`'s packed weights held in cpu_gemm's layout (0: none); `role`:
    only the layers of that role ("tiles": the second copies beside oneDNN's)."""
    return sum(m.kernel_weight.numel() * m.kernel_weight.element_size()
               for m in model.modules()
               if isinstance(m, PackedLinear) and m.kernel_weight is not None
               and role in (None, m.kernel_role))


def pack_linears(model: nn.Module, *, lm_head_weight: torch.Tensor | None = None) -> int:
    """Replace every `nn.Linear` below `model` by a PackedLinear; returns how many.

    `lm_head_weight`: a tied output projection (the embedding matrix) to pack too; it is
    installed as `model.lm_head`.
    """
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    if lm_head_weight is not None:
        model.lm_head = PackedLinear(lm_head_weight, None)
        count += 1
    return count
