"""CPU transform: every linear layer of a loaded model runs on oneDNN-packed weights.

NOTE: applied from outside the model after its weights are loaded (the model itself
knows only `nn.Linear`). oneDNN's blocked weight layout makes the skinny matmuls of a
decode step (a few to a few dozen rows against the whole weight) about twice as fast
as `F.linear` on plain row-major weights on AVX2 CPUs, and prefill a little faster;
`bench/` records the effect. Results agree with `F.linear` to float32 rounding.

bfloat16 weights are packed too where oneDNN has bf16 kernels for this CPU (AVX-512
BF16 or AMX: `_is_mkldnn_bf16_supported`); they accumulate in float32 and round once,
as `F.linear` in bf16 does. Where the CPU has AMX, a bf16 layer also keeps its weights in
the tile layout of loraplex_kernels/cpu_amx.py, which runs steps of up to 32 rows (a
decode step's) about 1.5x as fast as oneDNN there, with the same results; larger steps
stay on oneDNN. That second copy doubles the bf16 weights' memory (EngineConfig
cpu_amx turns it off).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loraplex_kernels import cpu_amx

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
    """y = x W^T + b with W held in oneDNN's packed layout. x [T, IN] -> [T, OUT]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        amx = None
        if (weight.dtype == torch.bfloat16 and cpu_amx.fits(*weight.shape)
                and cpu_amx.available()):
            amx = cpu_amx.pack_weight(weight.detach())
        self.amx_weight: torch.Tensor | None
        self.register_buffer("amx_weight", amx, persistent=False)

    def _amx_weight_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The AMX layout of the weight where the AMX kernel takes x, else None."""
        if (self.amx_weight is not None and x.dim() == 2
                and 0 < x.shape[0] <= cpu_amx.MAX_ROWS and x.stride(1) == 1
                and x.dtype == torch.bfloat16 and cpu_amx.available()):
            return self.amx_weight
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amx = self._amx_weight_for(x)
        if amx is not None:
            return cpu_amx.linear(x, amx, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [None], ""
        )

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate_up layer (the gate rows, then the up rows): silu(gate) * up of
        its output, [T, OUT / 2], in the same AMX pass as the matmul; None where that
        kernel does not take x (the caller then runs forward and the SiLU).

        NOTE: the same values bit for bit, without the [T, OUT] product written and read
        back: at 32 rows that pass was 66 us of a layer's ~1.3 ms decode step."""
        amx = self._amx_weight_for(x)
        if amx is not None and cpu_amx.silu_mul_fits(self.out_features):
            return cpu_amx.linear_silu_mul(x, amx, self.out_features, self.bias)
        return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def amx_weight_bytes(model: nn.Module) -> int:
    """The bytes of the AMX copies of `model`'s packed weights (0: none)."""
    return sum(m.amx_weight.numel() * m.amx_weight.element_size() for m in model.modules()
               if isinstance(m, PackedLinear) and m.amx_weight is not None)


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
